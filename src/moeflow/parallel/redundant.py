"""Redundant experts (DeepSeek's EPLB, beyond the papers): E experts in P = E + R physical slots.

The slots are spread evenly over the ranks (S = P / W each); hot experts get several slots
(replicas), and a replicated expert's tokens are split over its replicas. Unlike FasterMoE's
shadowing, which replicates for one iteration and moves weights every step, the replicas persist:
their weights move once per rebalance, and each backward sums their weight gradients over the
replicas (:class:`ReplicaGradSum`) so that every copy updates identically.

Three pieces, each a plain function of the placement:

- :func:`balanced_placement`: the slots from a recorded load, hierarchical: replica counts first
  (the expert with the highest load per replica gets the next slot), then the replicas packed over
  the nodes (equal slots per node, heaviest first onto the lightest node), then over the ranks of
  each node the same way, a rank holding an expert at most once where it can.
- :class:`ReplicaRowMap`: which of a rank's kept tokens of expert e go to which replica, from the
  global counts every rank already has (the same answer everywhere): the tokens of all ranks, in
  rank order, split into contiguous runs, one per replica in rank order, each sized so that the
  replicas' ranks end equally loaded (:mod:`moeflow.perf.replicas`), and equal senders keep their
  tokens on a replica of their own rank where one exists.
- :class:`SlotSchedule`: the expert-parallel schedule run over the slots. Their weights move with
  :func:`moeflow.parallel.moves.move_experts`, like any placement change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from moeflow.comm.collectives import all_reduce
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.ledger import tracked
from moeflow.comm.topology import Topology
from moeflow.core.device_copy import to_device
from moeflow.core.experts import FFNCompute, FFNWeights
from moeflow.parallel.chunk_pipeline import ExpertExchange, pipelined_experts
from moeflow.parallel.context import Prepared, RunContext, ScheduleOutput
from moeflow.parallel.placement import ExpertPlacement, ExpertShard
from moeflow.parallel.wrapped import WrappingSchedule
from moeflow.perf.replicas import balanced_slots, slot_split
from moeflow.perf.schedule_models import LOCAL, Plan


def slots_per_rank(redundant: int, num_experts: int, world_size: int) -> int:
    """S for ``redundant`` extra slots: replicas are slots of the expert-parallel exchange, which
    needs the same number on every rank."""
    slots = num_experts + redundant
    if slots % world_size:
        raise ValueError(
            f"redundant_experts={redundant} gives {slots} expert slots, which do not split evenly over {world_size} "
            f"ranks; choose redundant_experts so that num_experts + redundant_experts is a multiple of {world_size}"
        )
    return slots // world_size


def balanced_placement(
    load_E: Sequence[float], slots_per_rank: int, topology: Topology, hidden_dim: int
) -> ExpertPlacement:
    """EPLB's hierarchical placement of len(load_E) experts in slots_per_rank x W slots
    (:func:`moeflow.perf.replicas.balanced_slots`), each slot a whole expert."""
    slots = balanced_slots(load_E, slots_per_rank, topology.world_size, topology.ranks_per_node)
    ranks = tuple(tuple(ExpertShard(e, 0, hidden_dim) for e in experts) for experts in slots)
    return ExpertPlacement(len(load_E), hidden_dim, ranks, split_tokens=True)


def rank_loads(placement: ExpertPlacement, load_E: Sequence[float]) -> list[float]:
    """Each rank's share of ``load_E`` when every expert's load splits evenly over its replicas."""
    copies = [sum(s.expert == e for rank in placement.shards for s in rank) for e in range(placement.num_experts)]
    return [sum(float(load_E[s.expert]) / copies[s.expert] for s in shards) for shards in placement.shards]


@dataclass(frozen=True)
class ReplicaRowMap:
    """For one iteration, from the global counts: which rows of this rank's (E, C) logical buffer go
    to which physical slot (rank-major: slot p on rank p // S). A rank's tokens for its own slots
    are computed where they are (``local_rows_SC``); only the rest is exchanged
    (``exchanged_rows_PC``), over the capacity that the rest needs, so a replica that keeps its
    rank's tokens at home also keeps them off the link."""

    exchanged_rows_PC: torch.Tensor  # (P, C_x): row index into the flattened (E * C + 1) buffer
    local_rows_SC: torch.Tensor  # (S, C_l): this rank's own tokens for its own slots
    filled_WP: torch.Tensor  # (W, P) tokens each source rank routes to each slot
    exchanged_WP: torch.Tensor  # the same without each rank's tokens for its own slots
    logical_slots: int  # E * C: row E * C is a zero row (padding)

    @staticmethod
    def of(placement: ExpertPlacement, filled_WE: torch.Tensor, capacity: int, rank: int) -> ReplicaRowMap:
        filled = filled_WE.to("cpu", torch.long).numpy()
        world, num_experts = filled.shape
        slot_experts, slot_ranks = (np.array(column) for column in placement.slots())
        starts, lengths = slot_split(filled, slot_experts, slot_ranks)
        per_rank = len(slot_experts) // world
        own = np.arange(len(slot_experts)) // per_rank == np.arange(world)[:, None]  # (W, P): slot on the source
        exchanged = np.where(own, 0, lengths)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        pad = num_experts * capacity
        rows_x = _rows(slot_experts * capacity + starts[rank], exchanged[rank], int(exchanged.max()), pad)  # all ranks
        rows_l = _rows(slot_experts[mine] * capacity + starts[rank, mine], lengths[rank, mine],
                       int(lengths[rank, mine].max(initial=0)), pad)
        # all on the host, where the counts live: the rows go to the buffer's device where they index it
        return ReplicaRowMap(*(torch.from_numpy(a) for a in (rows_x, rows_l, lengths, exchanged)), pad)

    @staticmethod
    def gather(dispatched_ECM: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The (slots, C', M) buffer of ``rows`` of the logical buffer (padding rows are zeros)."""
        flat = dispatched_ECM.reshape(-1, dispatched_ECM.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        return padded.index_select(0, to_device(rows.reshape(-1), flat.device)).view(*rows.shape, -1)

    def scatter(self, exchanged_PCM: torch.Tensor, local_SCM: torch.Tensor, experts: int) -> torch.Tensor:
        """The (E, C, M) combined buffer from both parts (slots no token filled are zero)."""
        model_dim = exchanged_PCM.shape[-1]
        out = exchanged_PCM.new_zeros(self.logical_slots + 1, model_dim)
        for rows, part in ((self.exchanged_rows_PC, exchanged_PCM), (self.local_rows_SC, local_SCM)):
            out = out.index_copy(0, to_device(rows.reshape(-1), out.device), part.reshape(-1, model_dim))
        return out[: self.logical_slots].view(experts, -1, model_dim)


def _rows(first_P: np.ndarray, length_P: np.ndarray, width: int, pad: int) -> np.ndarray:
    """(P, width) row indices (at least one column): slot p's run first_p .. first_p + length_p,
    then ``pad``."""
    offsets = np.arange(max(1, width))
    return np.where(offsets < length_P[:, None], first_P[:, None] + offsets, pad).astype(np.int64)


@dataclass(frozen=True)
class ReplicaExperts:
    """A rank's slots as the schedules see experts: the compute, the count, and weights taken once
    per forward (through :func:`replica_weights`), so that the exchanged and the local part share
    one gradient sum over the replicas."""

    compute: FFNCompute
    num_experts: int
    synced: FFNWeights

    def weights(self) -> FFNWeights:
        return self.synced


def replica_weights(weights: FFNWeights, placement: ExpertPlacement, rank: int, groups: ParallelGroups) -> FFNWeights:
    """The slot weights passed through :class:`ReplicaGradSum` (over ``groups.expert``, in its ledger)."""
    stored = weights.as_tuple()
    present = [w for w in stored if w is not None]
    synced = iter(ReplicaGradSum.apply(placement, rank, groups, *present))
    return FFNWeights(*(None if w is None else next(synced) for w in stored))


class ReplicaGradSum(torch.autograd.Function):
    """Identity on the slot weights whose backward gives every replica of an expert the sum of
    all its replicas' gradients (one all-reduce of the replicated experts' rows), so that the
    copies, equal before the step, stay equal after it; a sole copy keeps its own gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, placement: ExpertPlacement, rank: int, groups: ParallelGroups, *weights: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.placement, ctx.rank, ctx.groups = placement, rank, groups  # type: ignore[attr-defined]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        placement: ExpertPlacement = ctx.placement  # type: ignore[attr-defined]
        groups: ParallelGroups = ctx.groups  # type: ignore[attr-defined]
        with tracked(groups.ledger, "replica gradient all-reduce", groups.expert):
            summed = sum_over_replicas(list(grads), placement, ctx.rank, groups.expert)  # type: ignore[attr-defined]
        return (None, None, None, *summed)


def replicated_experts(placement: ExpertPlacement) -> list[int]:
    """The experts held in more than one slot."""
    slot_experts = placement.slots()[0]
    return sorted({e for e in slot_experts if slot_experts.count(e) > 1})


def sum_over_replicas(
    grads: list[torch.Tensor], placement: ExpertPlacement, rank: int, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Each (S, ...) gradient with the replicated experts' rows replaced by their sum over all slots."""
    shared = replicated_experts(placement)
    if not shared:
        return grads
    row = {expert: i for i, expert in enumerate(shared)}
    local = [(index, row[s.expert]) for index, s in enumerate(placement.local(rank)) if s.expert in row]
    slot_index = torch.tensor([i for i, _ in local], dtype=torch.long, device=grads[0].device)
    shared_index = torch.tensor([r for _, r in local], dtype=torch.long, device=grads[0].device)
    sums = [g.new_zeros(len(shared), *g.shape[1:]).index_add_(0, shared_index, g.index_select(0, slot_index))
            for g in grads]
    flat = torch.cat([s.reshape(-1) for s in sums])
    if group is not None and placement.world_size > 1:
        all_reduce(flat, group)
    out, offset = [], 0
    for grad, summed in zip(grads, sums, strict=True):
        part = flat[offset: offset + summed.numel()].view_as(summed)
        offset += summed.numel()
        out.append(grad.index_copy(0, slot_index, part.index_select(0, shared_index)))
    return out


@dataclass(frozen=True)
class SlotSchedule(WrappingSchedule):
    """EPLB's slots around the expert-parallel schedule: each replica gets its share of an
    expert's tokens; the tokens for other ranks' slots run through the inner schedule as a
    (P, C', M) buffer, those for this rank's own slots here, and both return to the (E, C, M)
    layout. Weights move only when the placement does."""

    def prepare(self, capacity: int, filled_WE: torch.Tensor, placement: ExpertPlacement, rank: int) -> Prepared:
        """The replica row map of this forward, and the per-expert capacity of the same bytes as the
        exchanged slot buffer (what the planner prices)."""
        row_map = ReplicaRowMap.of(placement, filled_WE, capacity, rank)
        slots, width = row_map.exchanged_rows_PC.shape
        return Prepared(-(-slots * width // placement.num_experts), row_map)

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        row_map = ctx.prepared
        if not isinstance(row_map, ReplicaRowMap):  # run without prepare (a direct call)
            row_map = ReplicaRowMap.of(ctx.placement, ctx.filled_WE, ctx.capacity, ctx.rank)
        weights = replica_weights(ctx.experts.weights(), ctx.placement, ctx.rank, ctx.groups).cast(ctx.dtype)
        slots = ReplicaExperts(ctx.experts.compute, ctx.experts.num_experts, weights)
        mine = tuple(range(ctx.rank * slots.num_experts, (ctx.rank + 1) * slots.num_experts))
        exchanged = dataclasses.replace(ctx, experts=slots, filled_WE=row_map.exchanged_WP, local=mine)
        inner = self.inner.run(plan, row_map.gather(dispatched_ECM, row_map.exchanged_rows_PC), exchanged)
        own = dataclasses.replace(exchanged, filled_WE=row_map.filled_WP).own_compute(mine)
        local_SCM = pipelined_experts(
            row_map.gather(dispatched_ECM, row_map.local_rows_SC), own, weights,
            ExpertExchange(None, LOCAL, slots.num_experts), 1,
        )
        world = ctx.world_size
        rank_tokens = tuple(row_map.filled_WP.view(world, world, -1).sum(dim=(0, 2)).tolist())
        combined_ECM = row_map.scatter(inner.combined_ECM, local_SCM, ctx.placement.num_experts)
        return ScheduleOutput(combined_ECM, rank_tokens, cross_node_rows=inner.cross_node_rows)
