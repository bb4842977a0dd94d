"""Differentiable all-to-all over ``torch.distributed``.

Contract shared by every all-to-all algorithm: the input is laid out by destination rank along
dim 0 and the output by source rank. The gradient of an all-to-all is the all-to-all of the
gradient with the splits swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx


def linear_all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int] | None,
    input_splits: list[int] | None,
) -> torch.Tensor:
    """``dist.all_to_all_single`` into a fresh output, outside autograd (None splits: equal)."""
    x = x.contiguous()
    rows = x.shape[0] if output_splits is None else sum(output_splits)
    output = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(output, x, output_splits, input_splits, group=group)
    return output


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup,
        output_splits: list[int] | None, input_splits: list[int] | None,
    ) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return linear_all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        grad_x = linear_all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits)
        return grad_x, None, None, None


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Linear all-to-all (``dist.all_to_all_single``), equal splits unless given."""
    return _AllToAll.apply(x, group, output_splits, input_splits)
