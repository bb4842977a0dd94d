"""Weights between a Hugging Face MoE block and a MoELayer's state dict (all E experts).

transformers stores a projection as ``nn.Linear`` weights, (out, in). Two expert layouts exist:
per-expert modules (v4: ``w1``/``w3``/``w2`` for Mixtral, ``gate_proj``/``up_proj``/``down_proj``
for Qwen-MoE and DeepSeek) and fused tensors (v5: ``gate_up_proj`` (E, 2I, H) holding the gate rows
then the up rows, ``down_proj`` (E, H, I)). The fused tensors' experts-interface flags say where a
family departs: ``is_transposed`` (gpt-oss: (E, H, 2I) and (E, I, H)), ``is_concatenated=False``
(gpt-oss: gate and up rows interleaved, gate first) and ``has_bias`` (``gate_up_proj_bias`` (E, 2I)
in the same order, ``down_proj_bias`` (E, H)). moeflow's experts multiply from the right: ``w1``
(E, M, I) the gate, ``w3`` (E, M, I) the up projection, ``w2`` (E, I, M) the down projection, and
``b1``, ``b3``, ``b2`` their biases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeflow.hf.families import Family, router_bias, router_weight, selection_bias, shared_mlp

PER_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class FusedLayout:
    """A fused experts module's experts-interface flags (transformers' defaults where one is unset:
    per-expert v4 modules read as these defaults)."""

    transposed: bool = False  # is_transposed: (E, H, 2I) and (E, I, H)
    concatenated: bool = True  # is_concatenated: the gate rows, then the up rows (else interleaved pairs)
    biased: bool = False  # has_bias: gate_up_proj_bias (E, 2I) and down_proj_bias (E, H)

    @staticmethod
    def of(experts: nn.Module) -> FusedLayout:
        default = FusedLayout()
        return FusedLayout(bool(getattr(experts, "is_transposed", default.transposed)),
                           bool(getattr(experts, "is_concatenated", default.concatenated)),
                           bool(getattr(experts, "has_bias", default.biased)))


def _has_fused_projections(module: nn.Module) -> bool:
    """Whether ``module`` holds its gate and up projections as one ``gate_up_proj``, beside ``down_proj``."""
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")


def _projection_names(module: nn.Module) -> tuple[str, str, str]:
    for names in PER_EXPERT_NAMES:
        if all(hasattr(module, n) for n in names):
            return names
    raise ValueError(
        f"{type(module).__name__} has neither w1/w3/w2 nor gate_proj/up_proj/down_proj projections; "
        "moeflow.hf reads SwiGLU experts in those layouts only"
    )


def mlp_tensors(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate (I, H), up (I, H), down (H, I)) of one bias-free SwiGLU MLP module (its gate and up
    projections apart, or one ``gate_up_proj`` holding the gate rows then the up rows: MiniMax-M3's)."""
    fused = _has_fused_projections(mlp)
    projections = [mlp.gate_up_proj, mlp.down_proj] if fused else [getattr(mlp, n) for n in _projection_names(mlp)]
    if any(getattr(p, "bias", None) is not None for p in projections):
        raise ValueError(f"{type(mlp).__name__} has biases (the config's use_bias or mlp_bias); moeflow.hf converts "
                         "bias-free SwiGLU MLPs only: run this model through ep_implementation='moeflow' instead")
    if fused:
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
        return gate, up, mlp.down_proj.weight
    gate, up, down = (p.weight for p in projections)
    return gate, up, down


def expert_tensors(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate (E, I, H), up (E, I, H), down (E, H, I)) of either expert layout."""
    if isinstance(experts, nn.ModuleList):
        parts = [mlp_tensors(mlp) for mlp in experts]
        return tuple(torch.stack([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]
    if not _has_fused_projections(experts):
        raise ValueError(
            f"{type(experts).__name__} is neither a ModuleList of expert MLPs (transformers v4) nor fused "
            "gate_up_proj/down_proj tensors (v5)"
        )
    layout = FusedLayout.of(experts)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if layout.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = split_gate_up(layout, gate_up, dim=1)
    return gate, up, down


def split_gate_up(layout: FusedLayout, gate_up: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up parts of fused ``gate_up`` along ``dim``: halves, or interleaved rows (gpt-oss)."""
    if layout.concatenated:
        gate, up = gate_up.chunk(2, dim=dim)
        return gate, up
    pairs = gate_up.unflatten(dim, (-1, 2))
    return pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)


def join_gate_up(layout: FusedLayout, gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`split_gate_up`'s inverse."""
    if layout.concatenated:
        return torch.cat([gate, up], dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def expert_biases(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(gate (E, I), up (E, I), down (E, H)) biases of fused experts with ``has_bias``, else None."""
    layout = FusedLayout.of(experts)
    if not layout.biased:
        return None
    gate, up = split_gate_up(layout, experts.gate_up_proj_bias, dim=1)
    return gate, up, experts.down_proj_bias


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(source.to(target.dtype))


def write_mlp(mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    if _has_fused_projections(mlp):
        _copy(mlp.gate_up_proj.weight, torch.cat([gate, up], dim=0))
        _copy(mlp.down_proj.weight, down)
        return
    for name, value in zip(_projection_names(mlp), (gate, up, down), strict=True):
        _copy(getattr(mlp, name).weight, value)


def write_experts(experts: nn.Module, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    if isinstance(experts, nn.ModuleList):
        for e, mlp in enumerate(experts):
            write_mlp(mlp, gate[e], up[e], down[e])
        return
    layout = FusedLayout.of(experts)
    gate_up = join_gate_up(layout, gate, up, dim=1)
    if layout.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    _copy(experts.gate_up_proj, gate_up)
    _copy(experts.down_proj, down)


def write_expert_biases(experts: nn.Module, state: dict[str, torch.Tensor]) -> None:
    layout = FusedLayout.of(experts)
    if layout.biased:
        _copy(experts.gate_up_proj_bias, join_gate_up(layout, state["experts.b1"], state["experts.b3"], dim=1))
        _copy(experts.down_proj_bias, state["experts.b2"])


def _ffn_state(prefix: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """moeflow's (E, M, I) / (E, I, M) tensors from HF's (E, I, H) / (E, H, I) ones."""
    return {
        f"{prefix}w1": gate.detach().transpose(1, 2).contiguous(),
        f"{prefix}w3": up.detach().transpose(1, 2).contiguous(),
        f"{prefix}w2": down.detach().transpose(1, 2).contiguous(),
    }


def _ffn_from_state(state: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, ...]:
    return tuple(state[f"{prefix}{name}"].transpose(1, 2) for name in ("w1", "w3", "w2"))


def moeflow_state(block: nn.Module, family: Family) -> dict[str, torch.Tensor]:
    """The full MoELayer state dict (all E experts) holding ``block``'s weights."""
    state = {"gate.weight": router_weight(block, family).detach().clone()}
    bias = selection_bias(block, family)
    state["gate.expert_bias"] = (
        bias.detach().float().reshape(-1).clone() if bias is not None else torch.zeros(state["gate.weight"].shape[0])
    )
    state.update(_ffn_state("experts.", *expert_tensors(block.experts)))
    biases = expert_biases(block.experts)
    if biases is not None:
        names = ("experts.b1", "experts.b3", "experts.b2")
        state.update({name: b.detach().clone() for name, b in zip(names, biases, strict=True)})
    logit_bias = router_bias(block, family)
    if logit_bias is not None:
        state["gate.bias"] = logit_bias.detach().clone()
    shared = shared_mlp(block, family)
    if shared is not None:
        gate, up, down = mlp_tensors(shared)
        state.update(_ffn_state("shared_experts.", gate[None], up[None], down[None]))
    if family.shared_gate is not None:
        state["shared_expert_gate.weight"] = getattr(block, family.shared_gate).weight.detach().clone()
    return state


def write_hf_block(block: nn.Module, family: Family, state: dict[str, torch.Tensor]) -> None:
    """Put a full MoELayer state back into an HF block of the same shapes."""
    _copy(router_weight(block, family), state["gate.weight"])
    bias = selection_bias(block, family)
    if bias is not None:
        _copy(bias, state["gate.expert_bias"].reshape(bias.shape))
    write_experts(block.experts, *_ffn_from_state(state, "experts."))
    write_expert_biases(block.experts, state)
    logit_bias = router_bias(block, family)
    if logit_bias is not None:
        _copy(logit_bias, state["gate.bias"])
    shared = shared_mlp(block, family)
    if shared is not None:
        gate, up, down = (t[0] for t in _ffn_from_state(state, "shared_experts."))
        write_mlp(shared, gate, up, down)
    if family.shared_gate is not None:
        _copy(getattr(block, family.shared_gate).weight, state["shared_expert_gate.weight"])
