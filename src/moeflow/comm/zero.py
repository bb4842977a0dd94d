"""Sharded weights gathered for one computation, as ZeRO-3 does and Tutel's r = 0 needs.

Each rank stores one dim-0 shard of a weight (its experts, or its hidden slice). ``gather_shards``
all-gathers the full tensor for the forward; its backward reduce-scatters the gradient, so every
rank's shard receives the sum of the gradients that all ranks' tokens produced, the same sum that
expert parallelism gets by sending the tokens instead of the weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.collectives import all_gather_into, reduce_scatter_into
from moeflow.comm.groups import group_size
from moeflow.core.stats import PipelineTiming, region_clock


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, shard: torch.Tensor, group: dist.ProcessGroup, timing: PipelineTiming | None
    ) -> torch.Tensor:
        ctx.group, ctx.timing = group, timing
        world = group_size(group)
        full = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))
        all_gather_into(full, shard.contiguous(), group)
        return full

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_full: torch.Tensor):  # type: ignore[override]
        start = region_clock(ctx.timing)
        world = group_size(ctx.group)
        grad_shard = grad_full.new_empty((grad_full.shape[0] // world, *grad_full.shape[1:]))
        reduce_scatter_into(grad_shard, grad_full.contiguous(), ctx.group)
        if ctx.timing is not None:  # the layer's backward includes its gradient reduce-scatter
            ctx.timing.backward_s = (ctx.timing.backward_s or 0.0) + region_clock(ctx.timing) - start
        return grad_shard, None, None


def gather_shards(
    shard: torch.Tensor, group: dist.ProcessGroup, timing: PipelineTiming | None = None
) -> torch.Tensor:
    """The full tensor from every rank's equal dim-0 shard (rank order); differentiable: the
    gradient of a shard is the sum over ranks of the gradient of its rows. With a ``timing``, the
    backward's reduce-scatter adds its seconds to ``timing.backward_s``."""
    if group_size(group) == 1:
        return shard
    return _GatherShards.apply(shard, group, timing)
