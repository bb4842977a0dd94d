"""Tensor-parallel attention for a transformers model (``moeflow train --hf DIR --mp-size N``).

Each member of an MP group of N ranks keeps 1/N of every attention layer's heads, as the model's own
tensor-parallel plan (its config's ``base_model_tp_plan``) lays them out: the ``colwise``
projections (q, k, v, MLA's q_b and kv_b, gates, per-head sinks) keep their block of output rows,
the ``rowwise`` output projection its block of input columns. The collectives are Megatron's f and
g (:mod:`moeflow.comm.mp`): the attention's input is the identity whose backward sums the members'
partial gradients, the output projection's result is summed over the members. The MoE layers behind
it receive every token on every member and run Parm's schedules over the same MP group.

Why not transformers' own ``apply_tensor_parallelism``: its collectives are DTensor's, outside
``moeflow.comm``, where moeflow's own tensor-parallel attention and Parm's schedules behind it run
theirs on the same group; the plan is still the model's own, read from its config, so what is
split is what transformers splits.

An attention parameter that stays whole (q/k norms, MLA's down projections, the output bias) gets
only its member's heads' share of the gradient, so its gradient is scaled by N: the trainer's
average over all W workers is then the sum over the MP group averaged over the W / N replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moeflow.comm.groups import group_rank, group_size
from moeflow.comm.mp import copy_to_region, reduce_from_region
from moeflow.models.tensor_parallel import BlockShards
from moeflow.parallel.placement import PlacedParameter

SPLIT_AXIS = MappingProxyType({"colwise": 0, "rowwise": 1})
"""The axis a plan entry splits: a colwise projection's output rows, a rowwise one's input columns."""
KEPT_WHOLE = ("replicated_with_grad_allreduce", "mla_kv_a_proj", "local_params")
"""Plan entries that keep a tensor whole on every member (its gradient summed over them)."""
PLAN_PREFIX = "layers.*."
ATTENTION = "self_attn"
"""A decoder layer's attention module in every family's plan."""
EITHER_OF = MappingProxyType({"q_b_proj": "q_proj"})
"""Projections of which a layer has one: MLA's query is q_proj without a query LoRA rank, q_b_proj
with one, and some plans name only the second (both split alike)."""
SAME_ATTENTION = MappingProxyType({
    "deepseek_v3": "deepseek_v2", "sarvam_mla": "deepseek_v2", "mistral4": "deepseek_v2",
    "gpt_oss": "mimo_v2_flash", "openai_privacy_filter": "mimo_v2_flash",
    "granitemoe": "mixtral", "granitemoeshared": "mixtral", "hunyuan_v1_moe": "qwen3_moe",
})
"""Families transformers ships without a tensor-parallel plan whose attention has the named
family's projections, split as that family's plan splits them (each checked against the unsplit
model in tests/test_hf_tensor_parallel.py)."""


@dataclass(frozen=True)
class AttentionSplit:
    """Which tensors of a decoder layer's attention module are split over the MP group: the
    colwise ones (modules or parameters, paths in the attention module) and the rowwise output."""

    colwise: tuple[str, ...]
    output: str


def attention_split(config: Any, mp_size: int) -> AttentionSplit:
    """The split of the model's attention from its own plan, or a ValueError saying why it cannot
    run tensor parallel over ``mp_size`` members."""
    model_type = getattr(config, "model_type", "this model")
    entries = _attention_entries(config.base_model_tp_plan)
    if not entries and model_type in SAME_ATTENTION:
        from transformers import AutoConfig

        entries = _attention_entries(AutoConfig.for_model(SAME_ATTENTION[model_type]).base_model_tp_plan)
    if not entries:
        raise ValueError(f"--mp-size: transformers ships no tensor-parallel plan for {model_type}'s attention "
                         "(its config's base_model_tp_plan): run this model with --mp-size 1")
    odd = sorted({kind for _, kind in entries if kind not in (*SPLIT_AXIS, *KEPT_WHOLE)})
    if odd:
        raise ValueError(f"--mp-size: {model_type}'s attention splits as {', '.join(odd)} in transformers' plan "
                         "(tensors needed whole between its projections, e.g. q/k norms over all heads), which "
                         "moeflow's tensor-parallel attention does not run: use --mp-size 1")
    colwise = [path.split(".", 1)[1] for path, kind in entries if kind == "colwise"]
    colwise += [other for named, other in EITHER_OF.items() if named in colwise and other not in colwise]
    rowwise = [path.split(".", 1)[1] for path, kind in entries if kind == "rowwise"]
    if len(rowwise) != 1 or not colwise:
        raise ValueError(f"--mp-size: {model_type}'s attention plan has no single rowwise output projection "
                         "behind colwise ones: use --mp-size 1")
    _check_heads(config, mp_size, model_type)
    return AttentionSplit(tuple(colwise), rowwise[0])


def _attention_entries(plan: dict[str, str] | None) -> list[tuple[str, str]]:
    """(path in a decoder layer, kind) of a plan's entries for the attention module."""
    return [(key.removeprefix(PLAN_PREFIX), kind) for key, kind in (plan or {}).items()
            if key.startswith(PLAN_PREFIX) and key.removeprefix(PLAN_PREFIX).split(".")[0] == ATTENTION]


def _check_heads(config: Any, mp_size: int, model_type: str) -> None:
    """Each member gets whole heads: the query and the key/value heads divide by ``mp_size``."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % mp_size:
            raise ValueError(f"--mp-size {mp_size} does not divide {model_type}'s {name}={count}: use an "
                             f"--mp-size that divides {count}")


def split_attention(model: nn.Module, group: dist.ProcessGroup, world_size: int) -> dict[str, PlacedParameter]:
    """Keep this member's heads of every attention layer of ``model`` (in place) and run them tensor
    parallel over ``group``; return the split parameters' layouts by name (checkpoints assemble the
    full tensors from them)."""
    members, member = group_size(group), group_rank(group)
    split = attention_split(model.config, members)
    placed: dict[str, PlacedParameter] = {}
    for name, attention in _attention_modules(model):
        if _find(attention, split.output) is None:
            continue  # a hybrid model's other attention (linear, lightning): it runs whole on every member
        layer: dict[str, PlacedParameter] = {}
        for path in split.colwise:
            if _find(attention, path) is not None:  # (of EITHER_OF's pairs a layer has one)
                layer |= _split_tensors(attention, path, SPLIT_AXIS["colwise"], members, member, world_size)
        layer |= _split_tensors(attention, split.output, SPLIT_AXIS["rowwise"], members, member, world_size,
                                weight_only=True)
        _scale_whole_gradients(attention, set(layer), members)
        placed |= {f"{name}.{path}": where for path, where in layer.items()}
        attention.register_forward_pre_hook(_entering(group), with_kwargs=True)
        attention.get_submodule(split.output).register_forward_hook(_summed(group, members))
    return placed


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every decoder layer's attention (a hybrid model's other layers have none)."""
    return [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == ATTENTION
            and ".layers." in f".{name}"]


def _owner(attention: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module holding ``path``'s last part, and that part's name."""
    owner_path, _, leaf = path.rpartition(".")
    return attention.get_submodule(owner_path) if owner_path else attention, leaf


def _find(attention: nn.Module, path: str) -> Any:
    """The module or parameter at ``path`` in ``attention``, or None where this layer has none."""
    try:
        owner, leaf = _owner(attention, path)
    except AttributeError:
        return None
    return getattr(owner, leaf, None)


def _split_tensors(attention: nn.Module, path: str, axis: int, members: int, member: int, world_size: int,
                   weight_only: bool = False) -> dict[str, PlacedParameter]:
    """Replace the tensors at ``path`` (a Linear's weight and bias, or a parameter) by this member's
    block along ``axis``; their layouts by name in ``attention``."""
    owner, leaf = _owner(attention, path)
    target = getattr(owner, leaf)
    if isinstance(target, nn.Parameter):  # a per-head parameter (sinks)
        tensors = [(owner, leaf, axis, path)]
    else:
        tensors = [(target, "weight", axis, f"{path}.weight")]
        if not weight_only and getattr(target, "bias", None) is not None:  # a colwise bias: its output rows
            tensors.append((target, "bias", SPLIT_AXIS["colwise"], f"{path}.bias"))
    placed = {}
    for module, attribute, along, name in tensors:
        full: nn.Parameter = getattr(module, attribute)
        shards = BlockShards(world_size, members, along, full.shape[along])
        with torch.no_grad():
            local = shards.shard_tensor(attribute, full.detach(), member)
        setattr(module, attribute, nn.Parameter(local, requires_grad=full.requires_grad))
        placed[name] = PlacedParameter(shards, attribute)
    return placed


def _scale_whole_gradients(attention: nn.Module, split: set[str], members: int) -> None:
    """The attention's whole tensors see only this member's heads: their gradients times N."""
    for name, parameter in attention.named_parameters():
        if name not in split and parameter.requires_grad:
            parameter.register_hook(lambda grad: grad * members)


def _entering(group: dist.ProcessGroup) -> Callable[..., Any]:
    """The attention's input hidden states through Megatron's f (backward: the members' sum)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": copy_to_region(kwargs["hidden_states"], group)}
        else:
            args = (copy_to_region(args[0], group), *args[1:])
        return args, kwargs

    return hook


def _summed(group: dist.ProcessGroup, members: int) -> Callable[..., torch.Tensor]:
    """The output projection's partial results summed over the members (Megatron's g), its bias
    counted once: each member adds 1/N of it."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        bias = getattr(module, "bias", None)
        if bias is not None:
            output = output - (bias * (1 - 1 / members)).to(output.dtype)
        return reduce_from_region(output, group)

    return hook
