"""Clamped SwiGLU: the experts' gate half capped above and the up half capped both ways.

gpt-oss introduced it (transformers' ``swigluoai``) and HY-V4 and MiniMax-M3 copy it:
``g = min(x w1, limit)``, ``a = g * sigmoid(alpha g)``, ``u = clamp(x w3, -limit, limit) + up_offset``,
``y = (a * u) w2``. gpt-oss uses ``alpha = 1.702`` and ``up_offset = 1``; HY-V4 ``alpha = 1`` (silu)
and no offset. The cap keeps a bf16 expert's activations finite. An expert's compute carries one of
these in place of the ``"silu"`` name of plain SwiGLU's gate half (:func:`moeflow.core.experts.activate`
dispatches on it), so every expert kernel runs it; the gradients are those of the clamps (zero where a
value was capped, as ``torch.clamp``'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moeflow.config import MoEConfig


@dataclass(frozen=True)
class ClampedSwiGLU:
    """The three numbers of a clamped SwiGLU (see the module docstring; ``MoEConfig`` checks them)."""

    limit: float
    alpha: float = 1.0
    up_offset: float = 0.0

    def gate(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``min(h, limit) * sigmoid(alpha * min(h, limit))``, into ``out`` (or in place on ``h``)."""
        capped = h.clamp(max=self.limit)
        return torch.mul(capped, torch.sigmoid(capped * self.alpha), out=h if out is None else out)

    def gate_grad(self, grad_a: torch.Tensor, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The gradient of :meth:`gate` at ``h``: zero where ``h`` was capped."""
        capped = h.clamp(max=self.limit)
        sig = torch.sigmoid(capped * self.alpha)
        slope = sig * (1 + self.alpha * capped * (1 - sig))
        slope.masked_fill_(h > self.limit, 0)
        return torch.mul(grad_a, slope, out=out)

    def up(self, up: torch.Tensor) -> torch.Tensor:
        """``clamp(up, -limit, limit) + up_offset``, a new tensor (the raw ``up`` is what a backward reads)."""
        return up.clamp(-self.limit, self.limit).add_(self.up_offset)

    def up_grad_(self, grad_up: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``grad_up`` zeroed, in place, where the raw ``up`` was capped."""
        return grad_up.masked_fill_(up.abs() > self.limit, 0)


def clamp_of(config: MoEConfig) -> ClampedSwiGLU | None:
    """The clamped SwiGLU ``config`` asks for, if any (its ``swiglu_limit``, ``swiglu_alpha``, ``swiglu_up_offset``)."""
    if config.swiglu_limit is None:
        return None
    return ClampedSwiGLU(config.swiglu_limit, config.swiglu_alpha, config.swiglu_up_offset)
