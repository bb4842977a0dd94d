"""Process-group helpers: a layer built without an initialized process group runs single-process."""

from __future__ import annotations

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
