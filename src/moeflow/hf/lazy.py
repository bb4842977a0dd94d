"""Load a transformers MoE model holding only this rank's experts, from its safetensors files.

The model is built on the meta device (no memory), its sparse blocks are replaced by moeflow's,
which allocate this rank's experts only (the layer's :class:`~moeflow.parallel.ExpertPlacement`),
and every tensor is then read from the checkpoint: the non-expert ones whole, each local expert's
tensors (or, for hidden-sharded placements, their slices) and nothing of the others. Tensors land
in the dtypes ``from_pretrained`` gives them (its keep-in-fp32 rules included), and expert
weights pass through the dtype transformers would hold them in, so the model computes exactly
what ``from_pretrained`` + :func:`~moeflow.hf.replace_moe_blocks` gives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeflow.hf.blocks import Group, HFMoEBlock, replace_moe_blocks_unloaded
from moeflow.hf.families import router_bias, router_weight, selection_bias, shared_mlp
from moeflow.hf.safetensors_files import Index, SafetensorsCheckpoint
from moeflow.hf.weights import PER_EXPERT_NAMES, FusedLayout
from moeflow.moe.layer import MoELayer


@dataclass(frozen=True)
class Read:
    """Where a tensor comes from: checkpoint entry ``key``, its ``index`` slice, cast to ``via``
    (the dtype transformers holds it in) on the way, one of each pair along an axis (``pairs``:
    (axis, which), gpt-oss's interleaved gate and up), transposed (HF's (out, in) to moeflow's)."""

    key: str
    index: Index | None = None
    transpose: bool = False
    via: torch.dtype | None = None
    pairs: tuple[int, int] | None = None


def load_lazily(
    transformers: Any, directory: Path, config: Any, dtype: torch.dtype | None, group: Group, **layer_options: Any
) -> nn.Module:
    """The causal LM in ``directory`` with its MoE blocks on moeflow, read as described above."""
    with SafetensorsCheckpoint(directory) as checkpoint:
        dtype = dtype or _auto_dtype(config, checkpoint)
        model = _empty_model(transformers, config, dtype)
        replace_moe_blocks_unloaded(model, group, **layer_options)
        _materialize(model, torch.device("cpu"))
        names = _checkpoint_names(checkpoint, _renamings(model))
        for target, read in _reads(model, names):
            _copy(checkpoint, target, read)
    _check_not_meta(model)
    model.config.name_or_path = str(directory)
    if (directory / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory, local_files_only=True)
    return model


def _auto_dtype(config: Any, checkpoint: SafetensorsCheckpoint) -> torch.dtype:
    """``dtype="auto"`` as transformers resolves it: the config's, else the checkpoint's first float."""
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named)
    return named or checkpoint.first_float_dtype() or torch.get_default_dtype()


def _empty_model(transformers: Any, config: Any, dtype: torch.dtype) -> nn.Module:
    """The model on the meta device, in eval mode, its tensors in the dtypes ``from_pretrained``
    would load them in (``_keep_in_fp32_modules`` under fp16/bf16 included)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    plan_of = getattr(model, "_get_dtype_plan", None)
    plan: dict[str, torch.dtype] = plan_of(dtype) if plan_of is not None else {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        kept = next((d for p, d in plan.items() if re.search(p.replace("*", ".*"), name)), None)
        if kept is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(kept)
    return model.eval()


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Every meta tensor as an uninitialized one on ``device`` (a tensor shared by several modules,
    as tied embeddings are, stays shared); non-persistent buffers re-created by the model's init."""
    made: dict[int, torch.Tensor] = {}
    owners: dict[nn.Module, list[str]] = {}
    for module in model.modules():
        for slots, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in slots.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in made:
                    empty = torch.empty_like(tensor, device=device)
                    made[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if is_param else empty
                slots[name] = made[id(tensor)]
                if not is_param and name in module._non_persistent_buffers_set:
                    owners.setdefault(module, []).append(name)
    _recreate_non_persistent_buffers(model, owners)


@torch.no_grad()
def _recreate_non_persistent_buffers(model: nn.Module, owners: dict[nn.Module, list[str]]) -> None:
    """What ``from_pretrained`` does for the buffers no checkpoint holds (rotary ``inv_freq``): the
    model's own ``_init_weights``. Filled with NaN first, so that one it leaves alone is caught."""
    init = getattr(model, "_init_weights", None)
    for module, names in owners.items():
        floats = [name for name in names if getattr(module, name).is_floating_point()]
        for name in floats:
            getattr(module, name).fill_(math.nan)
        if init is not None:
            init(module)
        if any(bool(getattr(module, name).isnan().any()) for name in floats):
            raise ValueError(
                f"{type(model).__name__}._init_weights does not re-create the buffers {', '.join(names)} of "
                f"{type(module).__name__}, which no checkpoint holds; moeflow.hf cannot build this model without "
                "loading it whole"
            )


def _renamings(model: nn.Module) -> list[Any]:
    """The renames transformers applies to ``model``'s checkpoint keys on load (its conversion
    mapping's ``WeightRenaming`` entries; the expert merges it also lists are read per expert here)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]


def _checkpoint_names(checkpoint: SafetensorsCheckpoint, renamings: list[Any]) -> dict[str, str]:
    """Model-side name -> checkpoint key, after transformers' renames."""
    from transformers.core_model_loading import apply_renamings

    return {apply_renamings(key, renamings): key for key in checkpoint.files}


def _reads(model: nn.Module, names: dict[str, str]) -> list[tuple[torch.Tensor, Read]]:
    """What to read into every tensor of ``model`` that a checkpoint holds; fails naming what the
    checkpoint lacks, before anything is read."""
    blocks = {name: module for name, module in model.named_modules() if isinstance(module, HFMoEBlock)}
    reads = [read for prefix, block in blocks.items() for read in _block_reads(prefix, block, names)]
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not any(name.startswith(f"{prefix}.") for prefix in blocks):
            aliases.setdefault(id(tensor), []).append(name)  # tied weights: one tensor, several names
            tensors[id(tensor)] = tensor
    missing = []
    for ident, group in aliases.items():
        key = next((names[name] for name in group if name in names), None)
        if key is None:
            missing.append(group[0])
        else:
            reads.append((tensors[ident], Read(key)))
    if missing:
        raise ValueError(f"the checkpoint holds no tensor for {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                         + "; where transformers builds such tensors from others on load (its conversion mapping), "
                         "moeflow's per-rank reader cannot: load the model with transformers' DistributedConfig("
                         "ep_implementation='moeflow')")
    return reads


def _key(names: dict[str, str], name: str) -> str:
    if name not in names:
        raise ValueError(f"the checkpoint holds no tensor for {name}")
    return names[name]


def _block_reads(prefix: str, block: HFMoEBlock, names: dict[str, str]) -> list[tuple[torch.Tensor, Read]]:
    """A moeflow block's tensors from the transformers block's entries (``block``'s meta template
    holds the dtypes transformers would load them in)."""
    template, moe, family = block._template[0], block.moe, block.family
    weight = router_weight(template, family)
    reads = [(moe.gate.weight, Read(_key(names, f"{prefix}.{family.router}"), via=weight.dtype))]
    if family.router_bias is not None:
        logit_bias = router_bias(template, family)
        reads.append((moe.gate.bias, Read(_key(names, f"{prefix}.{family.router_bias}"), via=logit_bias.dtype)))
    bias = selection_bias(template, family)
    if bias is not None:
        key = _key(names, f"{prefix}.{family.bias}")
        reads.append((moe.gate.expert_bias.view(bias.shape), Read(key, via=bias.dtype)))
    via = next(template.experts.parameters()).dtype
    reads += _expert_reads(prefix, moe, template.experts, via, names)
    shared_module = shared_mlp(template, family)
    if shared_module is not None:
        shared = f"{prefix}.{family.shared}"
        via = next(shared_module.parameters()).dtype
        targets = (moe.shared_experts.w1[0], moe.shared_experts.w3[0], moe.shared_experts.w2[0])
        reads += [(t, read) for t, read in zip(targets, _shared_reads(names, shared, targets[0].shape[1], via),
                                                strict=True)]
    if family.shared_gate is not None:
        weight = getattr(template, family.shared_gate).weight
        reads.append((moe.shared_expert_gate.weight,
                      Read(_key(names, f"{prefix}.{family.shared_gate}.weight"), via=weight.dtype)))
    return reads


def _shared_reads(names: dict[str, str], prefix: str, hidden: int, via: torch.dtype) -> tuple[Read, Read, Read]:
    """The shared MLP's (gate, up, down): apart, or the halves of one ``gate_up_proj`` (MiniMax-M3's)."""
    fused = names.get(f"{prefix}.gate_up_proj.weight")
    if fused is None:
        gate, up, down = _projection_keys(names, prefix)
        return Read(gate, None, True, via), Read(up, None, True, via), Read(down, None, True, via)
    every, down = slice(None), _key(names, f"{prefix}.down_proj.weight")
    gate, up = (Read(fused, (slice(start, start + hidden), every), True, via) for start in (0, hidden))
    return gate, up, Read(down, None, True, via)


def _projection_keys(names: dict[str, str], prefix: str) -> tuple[str, str, str]:
    """The (gate, up, down) weight keys of the SwiGLU MLP at ``prefix`` (w1/w3/w2 or *_proj)."""
    projections = next((p for p in PER_EXPERT_NAMES if any(f"{prefix}.{n}.weight" in names for n in p)),
                       PER_EXPERT_NAMES[-1])
    gate, up, down = (_key(names, f"{prefix}.{n}.weight") for n in projections)
    return gate, up, down


def _expert_reads(
    prefix: str, moe: MoELayer, hf_experts: nn.Module, via: torch.dtype, names: dict[str, str]
) -> list[tuple[torch.Tensor, Read]]:
    """This rank's expert shards only, per expert (v4's and the original checkpoints' layout) or
    sliced out of fused ``gate_up_proj`` / ``down_proj`` tensors (:func:`_fused_reads`)."""
    experts = moe.experts
    fused = f"{prefix}.experts.gate_up_proj" in names
    every = slice(None)
    reads: list[tuple[torch.Tensor, Read]] = []
    for slot, shard in enumerate(moe.placement.local(moe.rank)):
        if fused:
            reads += _fused_reads(f"{prefix}.experts", moe, hf_experts, slot, via, names)
            continue
        rows = slice(shard.hidden_start, shard.hidden_stop)
        gate_key, up_key, down_key = _projection_keys(names, f"{prefix}.experts.{shard.expert}")
        sources = ((gate_key, (rows, every)), (up_key, (rows, every)), (down_key, (every, rows)))
        targets = (experts.w1[slot], experts.w3[slot], experts.w2[slot])
        reads += [(t, Read(key, index, True, via)) for t, (key, index) in zip(targets, sources, strict=True)]
    return reads


def _fused_reads(
    prefix: str, moe: MoELayer, hf_experts: nn.Module, slot: int, via: torch.dtype, names: dict[str, str]
) -> list[tuple[torch.Tensor, Read]]:
    """Slot ``slot``'s shard out of ``gate_up_proj`` ((E, 2I, H), or (E, H, 2I) transposed; halves or
    interleaved pairs), ``down_proj`` ((E, H, I) or (E, I, H)) and, with ``has_bias``, their biases."""
    experts, hidden = moe.experts, moe.placement.hidden_dim
    shard = moe.placement.local(moe.rank)[slot]
    start, stop, every = shard.hidden_start, shard.hidden_stop, slice(None)
    layout = FusedLayout.of(hf_experts)
    transposed, pairs = layout.transposed, not layout.concatenated
    spans = [(slice(2 * start, 2 * stop), part) for part in (0, 1)] if pairs else \
        [(slice(start, stop), None), (slice(hidden + start, hidden + stop), None)]
    gate_up, down = _key(names, f"{prefix}.gate_up_proj"), _key(names, f"{prefix}.down_proj")
    reads = []
    for target, (span, part) in zip((experts.w1[slot], experts.w3[slot]), spans, strict=True):
        index = (shard.expert, every, span) if transposed else (shard.expert, span, every)
        axis = 1 if transposed else 0
        reads.append((target, Read(gate_up, index, not transposed, via, None if part is None else (axis, part))))
    rows = slice(start, stop)
    reads.append((experts.w2[slot], Read(down, (shard.expert, rows, every) if transposed else
                                         (shard.expert, every, rows), not transposed, via)))
    if layout.biased:
        bias = _key(names, f"{prefix}.gate_up_proj_bias")
        for target, (span, part) in zip((experts.b1[slot], experts.b3[slot]), spans, strict=True):
            reads.append((target, Read(bias, (shard.expert, span), False, via, None if part is None else (0, part))))
        reads.append((experts.b2[slot], Read(_key(names, f"{prefix}.down_proj_bias"), (shard.expert, every),
                                             False, via)))
    return reads


@torch.no_grad()
def _copy(checkpoint: SafetensorsCheckpoint, target: torch.Tensor, read: Read) -> None:
    value = checkpoint.read(read.key, read.index)
    if read.via is not None:
        value = value.to(read.via)
    if read.pairs is not None:
        axis, which = read.pairs
        value = value.unflatten(axis, (-1, 2)).select(axis + 1, which)
    if read.transpose:
        value = value.T
    if value.shape != target.shape:
        where = "" if read.index is None else f" (slice {read.index})"
        raise ValueError(f"checkpoint tensor {read.key}{where} has shape {tuple(value.shape)}; the model expects "
                         f"{tuple(target.shape)}")
    target.copy_(value)


def _check_not_meta(model: nn.Module) -> None:
    """Every parameter and buffer holds memory (a meta one would fail only at the first forward)."""
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"loading left {', '.join(left)} on the meta device")
