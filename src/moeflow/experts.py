"""Batched expert FFNs: all local experts in a few large GEMMs.

Shapes: L local experts, C tokens per expert (W*C after dispatch), M model dim, H hidden dim.
Parameters ``w1`` (L, M, H), ``b1`` (L, H), ``w2`` (L, H, M), ``b2`` (L, M), and for swiglu ``w3``
(L, M, H) without bias: swiglu(x) = (silu(x w1 + b1) * (x w3)) w2 + b2.

Two kernels compute the same function: ``bmm`` (one batched GEMM per projection, ``baddbmm`` fuses
the bias) and ``loop`` (one ``addmm`` per expert). ``moeflow bench layer`` measures both; bmm is the
default because it was never slower on the shapes measured (see the README).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact erf form, torch's default
    "silu": F.silu,
    "swiglu": F.silu,  # applied to the gate projection, multiplied by the w3 projection
}


class ExpertFFN(nn.Module):
    """``num_experts`` independent two-layer FFNs evaluated together on (L, C, M) input."""

    def __init__(
        self, num_experts: int, model_dim: int, hidden_dim: int, activation: str = "gelu",
        kernel: str = "bmm",
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(_ACTIVATIONS)}")
        self.activation = activation
        self.kernel = kernel
        self.w1 = nn.Parameter(torch.empty(num_experts, model_dim, hidden_dim))
        self.b1 = nn.Parameter(torch.zeros(num_experts, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, model_dim))
        self.b2 = nn.Parameter(torch.zeros(num_experts, model_dim))
        if activation == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_experts, model_dim, hidden_dim))
        self.reset_parameters()

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def reset_parameters(self) -> None:
        model_dim, hidden_dim = self.w1.shape[1], self.w1.shape[2]
        for name, fan_in in (("w1", model_dim), ("w2", hidden_dim), ("w3", model_dim)):
            weight = getattr(self, name, None)
            if weight is not None:
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(weight, -bound, bound)
        nn.init.zeros_(self.b1)
        nn.init.zeros_(self.b2)

    def forward(self, x_LCM: torch.Tensor) -> torch.Tensor:
        if self.kernel == "loop":
            return torch.stack([self._one_expert(x_LCM[e], e) for e in range(self.num_experts)])
        hidden_LCH = torch.baddbmm(self.b1.unsqueeze(1), x_LCM, self.w1)
        hidden_LCH = _ACTIVATIONS[self.activation](hidden_LCH)
        if self.activation == "swiglu":
            hidden_LCH = hidden_LCH * torch.bmm(x_LCM, self.w3)
        return torch.baddbmm(self.b2.unsqueeze(1), hidden_LCH, self.w2)

    def _one_expert(self, x_CM: torch.Tensor, e: int) -> torch.Tensor:
        hidden_CH = _ACTIVATIONS[self.activation](torch.addmm(self.b1[e], x_CM, self.w1[e]))
        if self.activation == "swiglu":
            hidden_CH = hidden_CH * (x_CM @ self.w3[e])
        return torch.addmm(self.b2[e], hidden_CH, self.w2[e])


def ffn_flops(num_tokens: int, model_dim: int, hidden_dim: int, activation: str, backward: bool) -> int:
    """Floating-point work of the expert GEMMs for ``num_tokens`` routed tokens (the roofline's
    compute term); backward costs twice the forward (grad of input and of weight)."""
    projections = 3 if activation == "swiglu" else 2
    forward = 2 * num_tokens * model_dim * hidden_dim * projections
    return forward * (3 if backward else 1)


def shard_expert_state(
    full_state: Mapping[str, torch.Tensor], rank: int, world_size: int, prefix: str = "experts."
) -> dict[str, torch.Tensor]:
    """Slice a state dict holding all E experts down to the experts of ``rank``.

    Expert e lives on rank e // E_local at local index e % E_local; other entries are copied.
    """
    sharded: dict[str, torch.Tensor] = {}
    for name, tensor in full_state.items():
        if name.startswith(prefix) or f".{prefix}" in name:
            if tensor.shape[0] % world_size:
                raise ValueError(
                    f"{name} holds {tensor.shape[0]} experts, not divisible by world size {world_size}"
                )
            local = tensor.shape[0] // world_size
            tensor = tensor[rank * local : (rank + 1) * local]
        sharded[name] = tensor.clone()
    return sharded
