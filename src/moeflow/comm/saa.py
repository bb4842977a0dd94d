"""Parm's simultaneous all-to-all and all-gather (SAA, III-D), in the form S2's combine runs it.

The combine's all-to-all runs as pairwise phases, and the block a rank holds after a phase is
all-gathered over the MP group while the next phase is in flight: the all-to-all is mostly
inter-node and the all-gather intra-node, so the two use different links
(:func:`ep_esp_combine_allgather`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.comm.collectives import all_gather_into


def _exchange(operations: list[dist.P2POp]) -> None:
    """One phase's sends and receives, posted as one batch (NCCL would deadlock on two ranks that
    each post their receive before their send as separate calls)."""
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()


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
            pending.append(all_gather_into(gathered[block], summed_blocks[block], mp_group, async_op=True))
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
