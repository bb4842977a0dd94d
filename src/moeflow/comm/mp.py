"""Rows of a tensor that is replicated over a tensor-parallel (MP) group, split and gathered as
Megatron's "scatter to / gather from the model-parallel region" do.

A tensor replicated over the MP group has the same gradient on every member (its consumers are
replicated too). So the split's backward all-gathers the members' row gradients, and the gather's
backward keeps this member's rows. Parm's PauseMP (§III-B) is this pair: MP-Split (free forward,
an all-gather in backward) and MP-AllGather (an all-gather forward, free backward).

Member j owns rows [j * ceil(T / n), (j + 1) * ceil(T / n)) clipped to T, so every member knows
every member's rows without communicating; a short last member is padded for the all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.collectives import all_gather_into
from moeflow.comm.groups import group_rank, group_size
from moeflow.core.stats import PipelineTiming, region_clock


def member_rows(num_rows: int, members: int, member: int) -> tuple[int, int]:
    """[start, stop) of the rows ``member`` owns out of ``num_rows`` split over ``members``."""
    share = -(-num_rows // members) if members else 0
    return min(member * share, num_rows), min((member + 1) * share, num_rows)


def _all_gather_rows(rows: torch.Tensor, num_rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every member's rows of a ``num_rows``-row tensor, in member order."""
    members = group_size(group)
    share = -(-num_rows // members)
    padded = rows.new_zeros((share, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = rows.new_empty((members * share, *rows.shape[1:]))
    all_gather_into(gathered, padded, group)
    return gathered[:num_rows]


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, full: torch.Tensor, group: dist.ProcessGroup, timing: PipelineTiming | None
    ) -> torch.Tensor:
        ctx.group, ctx.num_rows, ctx.timing = group, full.shape[0], timing
        start, stop = member_rows(full.shape[0], group_size(group), group_rank(group))
        return full[start:stop]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_rows: torch.Tensor):  # type: ignore[override]
        start = region_clock(ctx.timing)
        grad = _all_gather_rows(grad_rows.contiguous(), ctx.num_rows, ctx.group)
        if ctx.timing is not None:  # the layer's backward includes this all-gather
            ctx.timing.backward_s = (ctx.timing.backward_s or 0.0) + region_clock(ctx.timing) - start
        return grad, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, rows: torch.Tensor, num_rows: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_rows(rows.contiguous(), num_rows, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_full: torch.Tensor):  # type: ignore[override]
        start, stop = member_rows(grad_full.shape[0], group_size(ctx.group), group_rank(ctx.group))
        return grad_full[start:stop], None, None


def split_rows(full: torch.Tensor, group: dist.ProcessGroup, timing: PipelineTiming | None = None) -> torch.Tensor:
    """This member's rows of a tensor replicated over ``group`` (backward: all-gather, whose
    seconds a ``timing`` adds to its ``backward_s``)."""
    return _SplitRows.apply(full, group, timing)


def gather_rows(rows: torch.Tensor, num_rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The replicated ``num_rows``-row tensor from every member's rows (backward: own rows)."""
    return _GatherRows.apply(rows, num_rows, group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A replicated input entering a tensor-parallel computation (Megatron's f): the identity,
    whose backward sums the members' partial input gradients."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of the members' partial outputs, replicated (Megatron's g): an all-reduce whose
    backward is the identity (the output's gradient is the same on every member)."""
    return _ReduceFromRegion.apply(partial, group)
