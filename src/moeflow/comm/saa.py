"""Parm's simultaneous all-to-all and all-gather (SAA, III-D).

Computes ``all_gather(mp_group, all_to_all(a2a_group, x))`` with the two overlapped: the all-to-all
runs as n pairwise phases (in phase j a rank sends to a2a peer i + j and receives from i - j), and
the slice received in phase j is all-gathered over the MP group while phase j + 1 is in flight.
The all-to-all is mostly inter-node and the all-gather intra-node, so the two use different links.

Groups: the members of one MP group share their index in their own all-to-all group (Parm's S2
layout), so in phase j every MP member receives from the same source index.

Shapes: ``x`` holds n equal chunks laid out by destination (a2a group order); the result is
(mp_size * n * chunk, ...) ordered by (MP member, source).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.alltoall import all_to_all


def _exchange(operations: list[dist.P2POp]) -> None:
    """One phase's sends and receives, posted as one batch (NCCL would deadlock on two ranks that
    each post their receive before their send as separate calls)."""
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()


def _phases(x: torch.Tensor, a2a_group: dist.ProcessGroup, mp_group: dist.ProcessGroup) -> torch.Tensor:
    n, me = dist.get_world_size(a2a_group), dist.get_rank(a2a_group)
    mp_size = dist.get_world_size(mp_group)
    chunks = x.chunk(n) if n > 0 else ()
    gathered: list[list[torch.Tensor]] = [[] for _ in range(n)]
    pending = []
    for step in range(n):
        to_peer, from_peer = (me + step) % n, (me - step) % n
        if step == 0:
            received = chunks[me]
        else:
            received = torch.empty_like(chunks[0])
            source, target = dist.get_global_rank(a2a_group, from_peer), dist.get_global_rank(a2a_group, to_peer)
            _exchange([
                dist.P2POp(dist.irecv, received, source, a2a_group),
                dist.P2POp(dist.isend, chunks[to_peer].contiguous(), target, a2a_group),
            ])
        # overlap: gather this phase's slice over MP while the next phase's exchange proceeds
        gathered[from_peer] = [torch.empty_like(received) for _ in range(mp_size)]
        pending.append(dist.all_gather(gathered[from_peer], received.contiguous(), group=mp_group, async_op=True))
    for work in pending:
        work.wait()
    return torch.cat([gathered[source][member] for member in range(mp_size) for source in range(n)])


class _SimultaneousAllToAllAllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, a2a_group: dist.ProcessGroup, mp_group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.a2a_group, ctx.mp_group = a2a_group, mp_group
        return _phases(x.contiguous(), a2a_group, mp_group)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        # all-gather's gradient is a reduce-scatter over MP (one all-to-all + local sum), then the
        # all-to-all's own gradient: the reverse all-to-all
        mp_size = dist.get_world_size(ctx.mp_group)
        by_member = all_to_all(grad.contiguous(), ctx.mp_group)
        mine = by_member.view(mp_size, -1, *grad.shape[1:]).sum(dim=0)
        return all_to_all(mine.contiguous(), ctx.a2a_group), None, None


def simultaneous_alltoall_allgather(
    x: torch.Tensor, a2a_group: dist.ProcessGroup, mp_group: dist.ProcessGroup
) -> torch.Tensor:
    """``all_gather(mp_group, all_to_all(a2a_group, x))``, overlapped phase by phase (differentiable)."""
    if x.shape[0] % dist.get_world_size(a2a_group):
        raise ValueError(f"{x.shape[0]} rows cannot be split equally over the all-to-all group")
    return _SimultaneousAllToAllAllGather.apply(x, a2a_group, mp_group)


def ep_esp_combine_allgather(
    partial_LXM: torch.Tensor, esp_size: int, capacity: int, group: dist.ProcessGroup, mp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Parm's S2 combine with SAA (§III-D): :func:`moeflow.comm.ep_esp.ep_esp_combine` (fused
    EP&ESP all-to-all + local sum over the N_ESP shard partials) followed by the MP all-gather of
    the (E, C, M) result, overlapped. The all-to-all runs in N_EP phases; in phase i a rank receives
    the partials of ESP group ``ep - i`` (sending its own to ``ep + i``), sums them, and
    all-gathers that group's (L, C, M) block over MP while phase i + 1 is in flight (the summing
    variant of Parm's kernel). Where N_MP > N_ESP the members of an MP group sit in different EP
    groups and sum the blocks in different phases: every member all-gathers a block after the
    phase in which the last of them holds it (:func:`gather_phases`), so the members enqueue the
    all-gathers and the exchanges of the two communicators in one order (each gathering a block
    as soon as it held it paired the gathers up, but at different places among the exchanges:
    NCCL's order rule broken across the two communicators).

    Returns (E, N_MP * C, M): each expert's slots in MP-member order, as the serial combine then
    all-gather gives them. Not differentiable (the pipeline runs the adjoint exchange itself)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local, _, model_dim = partial_LXM.shape
    ep_size, ep = world // esp_size, rank // esp_size
    mp_size = dist.get_world_size(mp_group)
    by_source = partial_LXM.view(local, world, capacity, model_dim).transpose(0, 1).contiguous()
    gathered = partial_LXM.new_empty((ep_size, mp_size * local, capacity, model_dim))
    summed_blocks: dict[int, torch.Tensor] = {}
    member_eps = [dist.get_group_rank(group, dist.get_global_rank(mp_group, m)) // esp_size for m in range(mp_size)]
    gathered_after = gather_phases(member_eps, ep_size)  # the same on every MP member
    pending = []
    for phase in range(ep_size):
        source_ep, target_ep = (ep - phase) % ep_size, (ep + phase) % ep_size
        received = partial_LXM.new_empty((esp_size, local, capacity, model_dim))
        operations = []
        for member in range(esp_size):
            source, target = source_ep * esp_size + member, target_ep * esp_size + member
            if source == rank:
                received[member] = by_source[rank]
            else:
                operations.append(dist.P2POp(dist.irecv, received[member], dist.get_global_rank(group, source), group))
            if target != rank:
                operations.append(dist.P2POp(dist.isend, by_source[target], dist.get_global_rank(group, target), group))
        _exchange(operations)
        summed_blocks[source_ep] = received.sum(dim=0)  # the local combine of this group's experts
        for block in gathered_after[phase]:
            pending.append(dist.all_gather_single(gathered[block], summed_blocks[block], group=mp_group,
                                                  async_op=True))
    for work in pending:
        work.wait()
    by_member = gathered.view(ep_size, mp_size, local, capacity, model_dim)
    return by_member.permute(0, 2, 1, 3, 4).reshape(ep_size * local, mp_size * capacity, model_dim)


def gather_phases(member_eps: list[int], ep_size: int) -> list[list[int]]:
    """For each phase of the S2 combine, the EP groups' blocks an MP group all-gathers after it: a
    block once every member holds it (a member of EP group e receives group b's block in phase
    (e - b) mod N_EP), in block order. The same lists on every member, whatever its own EP group."""
    phases: list[list[int]] = [[] for _ in range(ep_size)]
    for block in range(ep_size):
        phases[max((ep - block) % ep_size for ep in member_eps)].append(block)
    return phases
