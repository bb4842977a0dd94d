"""Process-group helpers: a layer built without an initialized process group runs single-process."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def resolve_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """The group to use: the given one, the default one when torch.distributed is initialized,
    or None (single process)."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def max_over_ranks(values: Sequence[float], group: ProcessGroup | None = None) -> list[float]:
    """Element-wise maximum across the group's ranks, in one all-reduce: the slowest rank's
    times, which every rank then agrees on."""
    reduced = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced.tolist()
