"""The tied embedding across stages: the first stage looks tokens up in it, the last projects onto
it. Where the two stages sit on different ranks each holds a copy; their gradients are summed after
the backward (Megatron's embedding group), so both copies take the same optimizer step. The groups
are made up front by every rank, in one order, from the mesh."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moeflow.comm.collectives import all_reduce


def tied_embedding_group(
    mesh: DeviceMesh, first_pp_rank: int, last_pp_rank: int, timeout: timedelta | None = None,
) -> dist.ProcessGroup | None:
    """The group of this rank's two copies (the ranks at ``first_pp_rank`` and ``last_pp_rank`` on
    the ``pp`` dimension, the other coordinates equal); None where one rank holds both stages or
    this rank holds neither. Every rank of the mesh must call it (it makes every pair's group)."""
    if first_pp_rank == last_pp_rank:
        return None
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0)  # (pp, the other dimensions...)
    firsts, lasts = ranks[first_pp_rank].flatten().tolist(), ranks[last_pp_rank].flatten().tolist()
    mine = None
    for first, last in zip(firsts, lasts, strict=True):
        group = dist.new_group([first, last], timeout=timeout)
        if dist.get_rank() in (first, last):
            mine = group
    return mine


def sum_tied_gradients(weight: torch.nn.Parameter | None, group: dist.ProcessGroup | None) -> None:
    """Sum the two copies' gradients of the tied weight (a no-op without a group)."""
    if group is None or weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    all_reduce(weight.grad, group)
