"""A stage's router losses into the backward through its output (Megatron's MoEAuxLossAutoScaler).

Under a pipeline no stage sees the loss but the last, and the schedule calls backward on each
stage's output alone. The MoE layers' aux (and z) losses of a stage are therefore attached to the
activation the stage sends on: the forward returns a copy of the activation, and its backward
returns, besides the activation's gradient, a gradient of one for the stage's aux loss, as if that
loss had been added to the model's. :meth:`moeflow.pipeline.build.Pipeline.step` divides every
gradient by the micro-batches at the end of the step, the aux losses' with the language model's.
"""

from __future__ import annotations

from typing import Any

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return activation.clone()  # not a view: the zero-bubble schedules detach a stage's output in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``activation``, whose backward also sends a gradient of one into ``aux_loss`` (a no-op
    where the aux loss has no graph: zero weights, or no grad)."""
    if not aux_loss.requires_grad:
        return activation
    return _AttachAuxLoss.apply(activation, aux_loss)
