"""Gates (routers): map tokens to fp32 expert logits.

Logits come out in fp32. By default they are computed in fp32 whatever the input dtype: routing
decisions are discrete and low-precision logits flip them. A linear gate with
``logits_in_input_dtype`` computes them in the input's dtype first, as Mixtral's and Qwen-MoE's
routers do, so that a converted model routes exactly as it did. Each gate also owns
``expert_bias``, a selection-only bias: zero unless loaded (DeepSeek-V3's
``e_score_correction_bias``) or updated by auxiliary-loss-free balancing (a positive update rate).

State-dict names (fixed, so weights move between implementations):

- linear gate: ``weight`` (E, M)
- cosine gate: ``projection`` (P, M), ``weight`` (E, P) the expert embeddings, ``logit_scale`` (1,)
  holding log(1/temperature), clamped at log(1/min_temperature) when used
- both: buffer ``expert_bias`` (E,)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LinearGate(nn.Module):
    """logits = x W^T (+ b), the router of Switch/GShard/Tutel (gpt-oss's has the bias ``b``)."""

    def __init__(
        self, model_dim: int, num_experts: int, logits_in_input_dtype: bool = False, bias: bool = False
    ) -> None:
        super().__init__()
        self.logits_in_input_dtype = logits_in_input_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, model_dim))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        nn.init.normal_(self.weight, std=model_dim**-0.5)

    def forward(self, x_TM: torch.Tensor) -> torch.Tensor:
        dtype = x_TM.dtype if self.logits_in_input_dtype else torch.float32
        weight, bias = self.weight, self.bias
        if dtype == torch.float32 == weight.dtype == x_TM.dtype and (bias is None or bias.dtype == dtype):
            return F.linear(x_TM, weight, bias)  # fp32 already: no cast to call (a cold op each, at one token)
        return F.linear(x_TM.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()


class CosineGate(nn.Module):
    """Tutel's cosine router (paper C.3): softmax input is cos(Wx, m_e) / tau.

    The normalization makes routing insensitive to the scale of x; tau is learnable and never
    below ``min_temperature``.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        projection_dim: int = 256,
        min_temperature: float = 0.01,
        init_temperature: float = 0.5,
    ) -> None:
        super().__init__()
        self.projection = nn.Parameter(torch.empty(projection_dim, model_dim))
        self.weight = nn.Parameter(torch.empty(num_experts, projection_dim))
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(1.0 / init_temperature)))
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.max_logit_scale = math.log(1.0 / min_temperature)
        nn.init.normal_(self.projection, std=model_dim**-0.5)
        nn.init.normal_(self.weight, std=0.01)

    def forward(self, x_TM: torch.Tensor) -> torch.Tensor:
        projected_TP = F.normalize(F.linear(x_TM.float(), self.projection.float()), dim=-1)
        experts_EP = F.normalize(self.weight.float(), dim=-1)
        scale = self.logit_scale.float().clamp(max=self.max_logit_scale).exp()
        return F.linear(projected_TP, experts_EP) * scale


def build_gate(
    kind: str, model_dim: int, num_experts: int, projection_dim: int, min_temperature: float,
    precision: str = "fp32", bias: bool = False,
) -> LinearGate | CosineGate:
    """The gate ``MoEConfig.gate`` names: ``softmax`` a :class:`LinearGate`, ``cosine`` a :class:`CosineGate`."""
    if kind == "softmax":
        return LinearGate(model_dim, num_experts, logits_in_input_dtype=precision == "input", bias=bias)
    if kind == "cosine":
        return CosineGate(model_dim, num_experts, projection_dim, min_temperature)
    raise ValueError(f"unknown gate {kind!r}; choose softmax or cosine")
