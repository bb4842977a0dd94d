"""Swap the sparse MoE blocks of a transformers model for moeflow layers, and back.

``from_hf_block`` builds a :class:`HFMoEBlock`: a MoELayer holding the block's weights (copied),
routing as the block does (:mod:`moeflow.hf.families`), dropless (capacity factor 0), called and
returning as the block was (v4's ``(hidden, router_logits)`` or v5's hidden). With a process group
each rank keeps only its experts and tokens move by all-to-all. A copy of the original block is kept
on the meta device (no memory) so that ``to_hf`` can rebuild it in its own class and layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow.comm.groups import ParallelGroups
from moeflow.core.workspace import share_workspace
from moeflow.hf.families import (
    SUPPORTED,
    V4_TUPLE_BLOCKS,
    Family,
    expert_settings,
    family_of,
    router_bias,
    router_weight,
    routing_settings,
    selection_bias,
    shared_mlp,
)
from moeflow.hf.weights import FusedLayout, expert_tensors, mlp_tensors, moeflow_state, write_hf_block
from moeflow.kernels.choice import share_kernel_table
from moeflow.moe.layer import MoELayer
from moeflow.timing.phases import PhaseClock

Group = ParallelGroups | dist.ProcessGroup | None


LAYOUT_FLAGS = {"has_gate": True}
"""transformers' experts-interface flags moeflow needs: gated experts (the layout flags
``is_transposed``, ``is_concatenated`` and ``has_bias`` are read: :mod:`moeflow.hf.weights`)."""


def _is_silu(act: object) -> bool:
    return "silu" in type(act).__name__.lower() or getattr(act, "__name__", "") == "silu"


def _check_experts(block: nn.Module, family: Family) -> None:
    experts = block.experts
    act = experts[0].act_fn if isinstance(experts, nn.ModuleList) else getattr(experts, "act_fn", None)
    shared = shared_mlp(block, family)
    shared_act = getattr(shared, "act_fn", None)
    shared_clamped = family.clamp is not None and family.clamp.shared
    for what, function, checked in (("experts", act, family.clamp is None),
                                    ("shared MLP", shared_act, shared is not None and not shared_clamped)):
        if checked and not _is_silu(function):
            raise ValueError(
                f"the {what} of {type(block).__name__} use {type(function).__name__}; moeflow.hf converts SwiGLU "
                "with hidden_act='silu' only: run this model through ep_implementation='moeflow' instead"
            )
    differs = {flag: getattr(experts, flag) for flag, want in LAYOUT_FLAGS.items()
               if getattr(experts, flag, want) != want}
    if differs:
        raise ValueError(
            f"the experts of {type(block).__name__} have {differs}; moeflow.hf converts gated experts only: run "
            "this model through ep_implementation='moeflow' instead"
        )
    if FusedLayout.of(experts).biased and shared is not None:
        raise ValueError(
            f"the experts of {type(block).__name__} have biases beside a shared MLP; moeflow's layer gives both "
            "or neither biases: run this model through ep_implementation='moeflow' instead"
        )


def _returns_router_logits(block: nn.Module) -> bool:
    """transformers v4's Mixtral and Qwen-MoE blocks returned ``(hidden, router_logits)``; its
    per-expert layout is how a v4 block is told apart."""
    family = family_of(block)
    if family is not None and family.returns_scores:
        return True
    return isinstance(block.experts, nn.ModuleList) and family is not None and family.model_type in V4_TUPLE_BLOCKS


class HFMoEBlock(nn.Module):
    """A moeflow MoELayer behind the calling convention of a transformers sparse MoE block."""

    def __init__(self, moe: MoELayer, family: Family, returns_router_logits: bool, template: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.family = family
        self.returns_router_logits = returns_router_logits
        self._template = (template,)  # a tuple: not a submodule, not in the state dict
        self.clock: PhaseClock | None = None  # a trainer's, to time the MoE phase
        self.eval_capacity_factor: float | None = None  # None: the layer's own capacity factor in eval too

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        factor = None if self.training else self.eval_capacity_factor

        def run(x: torch.Tensor) -> torch.Tensor:
            return self.moe(x, capacity_factor=factor)

        y = run(hidden_states) if self.clock is None else self.clock.around("moe", hidden_states, run)
        if not self.returns_router_logits:
            return y
        if self.family.returns_scores:
            return y, None  # gpt-oss's decoder layer drops its block's second output
        # v4's router is an nn.Linear: its logits in the input's dtype
        return y, F.linear(hidden_states.reshape(-1, hidden_states.shape[-1]), self.moe.gate.weight)

    def to_hf(self) -> nn.Module:
        """The transformers block again, with this layer's weights (all experts: a collective
        over the expert group when the layer is spread)."""
        state = self.moe.full_state_dict()
        block = self._template[0].to_empty(device=self.moe.gate.weight.device)
        block.to(self.moe.experts.w1.dtype)
        router = router_weight(block, self.family)
        router.data = router.data.to(self.moe.gate.weight.dtype)  # an fp32 router stays fp32
        logit_bias = router_bias(block, self.family)
        if logit_bias is not None:
            logit_bias.data = logit_bias.data.to(self.moe.gate.bias.dtype)
        write_hf_block(block, self.family, state)
        block.train(self.training)
        return block


def _moe_layer(block: nn.Module, group: Group, layer_options: dict[str, Any]) -> tuple[MoELayer, Family]:
    """The MoELayer (default device and dtype, this rank's experts only) computing what ``block``
    does; only its shapes and settings are read, so ``block`` may be on the meta device."""
    family = family_of(block)
    if family is None:
        raise ValueError(f"from_hf_block cannot convert {type(block).__name__}; supported blocks: {SUPPORTED}")
    _check_experts(block, family)
    gate_IH = expert_tensors(block.experts)[0]
    num_experts, hidden_dim, model_dim = gate_IH.shape
    options: dict[str, Any] = {
        **routing_settings(block, family), **expert_settings(block, family), "capacity_factor": 0.0,
        "activation": "swiglu", "bias": FusedLayout.of(block.experts).biased,
        "expert_kernel": "ragged",
        "aux_loss_weight": 0.0, **layer_options,
    }
    shared = shared_mlp(block, family)
    if shared is not None:
        options["num_shared_experts"] = 1
        options["shared_hidden_dim"] = mlp_tensors(shared)[0].shape[0]
    options["shared_expert_gate"] = family.shared_gate is not None
    return MoELayer(model_dim, hidden_dim, num_experts, group=group, **options), family


def from_hf_block(block: nn.Module, group: Group = None, **layer_options: Any) -> HFMoEBlock:
    """A moeflow module computing what ``block`` computes, with its weights; ``layer_options``
    go to :class:`~moeflow.MoELayer` (``pipeline``, ``alltoall``, ``aux_loss_weight``, ...)."""
    moe, family = _moe_layer(block, group, layer_options)
    _to_block_dtypes(moe, block, family, device=router_weight(block, family).device)
    moe.load_full_state_dict(moeflow_state(block, family))
    hf_bias = selection_bias(block, family)
    if hf_bias is not None:  # the selection bias keeps its own dtype, as in transformers
        moe.gate.expert_bias.data = hf_bias.detach().reshape(-1).clone()
    moe.train(block.training)
    return HFMoEBlock(moe, family, _returns_router_logits(block), _meta_copy(block))


def unloaded_hf_block(block: nn.Module, group: Group = None, **layer_options: Any) -> HFMoEBlock:
    """``block``'s moeflow module in the dtypes ``block`` holds, on the CPU, with this rank's experts
    allocated but not loaded: for a loader that reads them from a checkpoint, so that no rank ever
    holds the experts of another (``block`` itself may be on the meta device)."""
    moe, family = _moe_layer(block, group, layer_options)
    _to_block_dtypes(moe, block, family)
    hf_bias = selection_bias(block, family)
    if hf_bias is not None:  # the selection bias keeps its own dtype, as in transformers
        moe.gate.expert_bias.data = torch.zeros(hf_bias.numel(), dtype=hf_bias.dtype)
    moe.train(block.training)
    return HFMoEBlock(moe, family, _returns_router_logits(block), _meta_copy(block))


def _to_block_dtypes(moe: MoELayer, block: nn.Module, family: Family, device: torch.device | None = None) -> None:
    """The layer in the experts' dtype, its router in the block's router's (which some families keep
    in fp32 in a bf16 model)."""
    moe.to(device=device, dtype=expert_tensors(block.experts)[0].dtype)
    moe.gate.weight.data = moe.gate.weight.data.to(router_weight(block, family).dtype)
    hf_bias = router_bias(block, family)
    if hf_bias is not None:
        moe.gate.bias.data = moe.gate.bias.data.to(hf_bias.dtype)


def _meta_copy(block: nn.Module) -> nn.Module:
    """``block`` with its tensors on the meta device: the class and layout, no memory."""
    memo: dict[int, Any] = {}
    for tensor in block.parameters():
        memo[id(tensor)] = nn.Parameter(torch.empty_like(tensor, device="meta"), tensor.requires_grad)
    for tensor in block.buffers():
        memo[id(tensor)] = torch.empty_like(tensor, device="meta")
    return copy.deepcopy(block, memo)


def replace_moe_blocks(model: nn.Module, group: Group = None, **layer_options: Any) -> nn.Module:
    """Replace every supported sparse MoE block of ``model`` in place (and return it)."""
    return _replace_blocks(model, lambda block: from_hf_block(block, group, **layer_options))


def replace_moe_blocks_unloaded(model: nn.Module, group: Group = None, **layer_options: Any) -> nn.Module:
    """Replace every supported sparse MoE block of ``model`` (which may be on the meta device) by an
    :func:`unloaded_hf_block`, whose weights a checkpoint reader then fills."""
    return _replace_blocks(model, lambda block: unloaded_hf_block(block, group, **layer_options))


def _replace_blocks(model: nn.Module, build: Callable[[nn.Module], HFMoEBlock]) -> nn.Module:
    targets = [(name, module) for name, module in model.named_modules() if family_of(module) is not None]
    if not targets:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"{type(model).__name__} (model_type={model_type!r}) has no sparse MoE block moeflow "
                         f"converts; supported architectures: {SUPPORTED}")
    for name, module in targets:
        model.set_submodule(name, build(module))
    share_workspace(block.moe for block in moe_blocks(model))
    share_kernel_table(block.moe for block in moe_blocks(model))
    return model


def moe_blocks(model: nn.Module) -> list[HFMoEBlock]:
    """The moeflow blocks of a converted model, in forward (module) order."""
    return [m for m in model.modules() if isinstance(m, HFMoEBlock)]


def to_hf(model: nn.Module) -> nn.Module:
    """Put transformers blocks back in place of every :class:`HFMoEBlock` (weights gathered), so
    that ``save_pretrained`` writes a checkpoint plain transformers loads."""
    for name, module in list(model.named_modules()):
        if isinstance(module, HFMoEBlock):
            model.set_submodule(name, module.to_hf())
    return model
