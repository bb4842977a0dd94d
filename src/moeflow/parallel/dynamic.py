"""A placement chosen per forward (Lina's inference scheduling, §5.2 and §6.2).

Each rank stores only its own experts (the layer's placement: expert parallel, packed, or any
placement of whole experts). Per forward, the layer's inference hook chooses a placement; rank r
computes the experts ``placement.local(r)``, fetching those it does not store from the rank that
stores them (:mod:`moeflow.parallel.expert_fetch`; the hook may have started the fetch a layer
ahead), so no rank ever holds more than its own experts and the copies of the layers in flight.
An expert held by several ranks gets its tokens split evenly over them (contiguous runs of all
ranks' tokens in rank order, as the scheduler's cost model assumes), and the tokens travel by one
all-to-all with unequal splits each way: each rank sends each other rank exactly the rows it
computes, with no capacity padding.

Lina keeps every expert in every device's host memory and swaps the ones it needs onto the GPU
(§6.2); moeflow fetches them from their owner instead, because no rank may hold the whole model.
This schedule only moves rows and weights; it runs in inference only (under ``torch.no_grad``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from moeflow.comm.alltoall import linear_all_to_all
from moeflow.comm.groups import ParallelGroups
from moeflow.core.experts import FFNCompute
from moeflow.core.stats import PipelineTiming
from moeflow.parallel.context import RunContext, ScheduleOutput
from moeflow.parallel.expert_fetch import ExpertFetch, start_fetch
from moeflow.parallel.inference_hook import InferenceHook
from moeflow.parallel.modelled import ModelledSchedule
from moeflow.parallel.placement import ExpertPlacement
from moeflow.perf import CostModel
from moeflow.perf.replicas import slot_split
from moeflow.perf.schedule_models import ExpertParallelModel, Plan, ScheduleModel


@dataclass(frozen=True)
class PlacedRowMap:
    """One forward's rows: which rows of this rank's flattened (E * C) buffer go to which rank
    (grouped by destination, then by the destination's local experts in order), and which of this
    rank's local experts each received row is for."""

    send_rows: torch.Tensor  # (N_send,) int64
    send_splits: list[int]  # rows to each rank
    recv_splits: list[int]  # rows from each rank
    recv_local: torch.Tensor  # (N_recv,) int64: local expert index of each received row
    rank_tokens: tuple[int, ...]  # rows each rank computes

    @staticmethod
    def of(placement: ExpertPlacement, filled_WE: torch.Tensor, capacity: int, rank: int) -> PlacedRowMap:
        filled = filled_WE.to("cpu", torch.long).numpy()
        world = filled.shape[0]
        slot_expert, slot_rank = (np.array(column) for column in placement.slots())
        starts, lengths = slot_split(filled, slot_expert, slot_rank, proportional=False)  # as Lina prices it
        rows = [np.arange(length) + slot_expert[p] * capacity + starts[rank, p]
                for p, length in enumerate(lengths[rank].tolist())]  # slots in rank-major order
        mine = np.flatnonzero(slot_rank == rank)
        recv_local = [np.full(lengths[source, p], index) for source in range(world) for index, p in enumerate(mine)]
        return PlacedRowMap(
            send_rows=torch.from_numpy(np.concatenate(rows).astype(np.int64)),
            send_splits=[int(lengths[rank, slot_rank == r].sum()) for r in range(world)],
            recv_splits=[int(lengths[source, mine].sum()) for source in range(world)],
            recv_local=torch.from_numpy(np.concatenate(recv_local).astype(np.int64)),
            rank_tokens=tuple(int(lengths[:, slot_rank == r].sum()) for r in range(world)),
        )


@dataclass(frozen=True)
class PlacedExperts:
    """This forward's experts as :class:`DynamicPlacementSchedule` needs them: the placement and the
    weights of each expert this rank computes (being fetched), the kept tokens' rows."""

    compute: FFNCompute
    fetch: ExpertFetch  # this forward's placement and its experts' weights, stored here or fetched
    row_map: PlacedRowMap
    rank: int

    @property
    def placement(self) -> ExpertPlacement:
        return self.fetch.placement

    @property
    def num_experts(self) -> int:
        return self.placement.num_local(self.rank)


def _exchange(x: torch.Tensor, groups: ParallelGroups, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    if groups.expert is None or groups.size == 1:
        return x
    with groups.ledger.tracked("all-to-all", groups.expert, x.numel() * x.element_size()):
        return linear_all_to_all(x, groups.expert, out_splits, in_splits)


def run_placed(dispatched_ECM: torch.Tensor, experts: PlacedExperts, groups: ParallelGroups,
               timing: PipelineTiming) -> torch.Tensor:
    """Send each row to the rank that computes it, run each local expert on its rows, send back."""
    if torch.is_grad_enabled():
        raise RuntimeError("a per-batch expert placement is an inference schedule: run the model under torch.no_grad()")
    start = timing.now()
    num_experts, capacity, model_dim = dispatched_ECM.shape
    row_map = experts.row_map
    flat = dispatched_ECM.reshape(-1, model_dim)
    received = _exchange(flat.index_select(0, row_map.send_rows), groups, row_map.recv_splits, row_map.send_splits)
    order = torch.argsort(row_map.recv_local, stable=True)
    bounds = torch.bincount(row_map.recv_local, minlength=experts.num_experts).cumsum(0).tolist()
    computed = torch.empty_like(received)
    weights = experts.fetch.wait()  # the copies arrived while the rows moved (or a layer ahead)
    expert_start = time.perf_counter()
    local = experts.placement.local(experts.rank)
    for shard, first, last in zip(local, [0, *bounds[:-1]], bounds, strict=True):
        if last > first:
            rows = order[first:last]
            one = weights[shard.expert].cast(received.dtype)  # fetched as stored
            computed[rows] = experts.compute.forward(received[rows].unsqueeze(0), one)[0][0]
    timing.expert_forward_s += time.perf_counter() - expert_start
    returned = _exchange(computed, groups, row_map.send_splits, row_map.recv_splits)
    combined = flat.new_zeros(num_experts * capacity, model_dim).index_copy_(0, row_map.send_rows, returned)
    timing.forward_s = timing.now() - start
    return combined.view(num_experts, capacity, model_dim)


@dataclass(frozen=True)
class DynamicPlacementSchedule(ModelledSchedule):
    """Each rank stores its own experts; each forward computes the experts of the placement that
    ``hook`` chooses for it (from the context's kept counts and estimates), fetching the ones it
    does not store, and moves rows by unequal all-to-alls. ``previous`` is what the layer ran
    before (to switch back to)."""

    scheduler: InferenceHook
    previous: object = field(default=None, compare=False)
    name: str = "dynamic"

    @property
    def model(self) -> ScheduleModel:
        return ExpertParallelModel()

    @property
    def hook(self) -> InferenceHook:
        return self.scheduler

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return ExpertPlacement.expert_parallel(num_experts, world_size, hidden_dim)

    def plan_label(self, plan: Plan) -> str:
        return self.name

    def plan_space(
        self, degree_policy: int | str, algorithms: tuple[str, ...], cost_model: CostModel | None
    ) -> tuple[int | str, tuple[str, ...], CostModel | None]:
        """One unpipelined linear exchange of unequal splits: nothing to plan."""
        return 1, ("linear",), None

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        fetch = functools.partial(start_fetch, ctx.experts.weights(), ctx.placement, rank=ctx.rank, groups=ctx.groups)
        placed = self.scheduler.placement(ctx.filled_WE.sum(0), ctx.estimate_E, ctx.placement, fetch)
        row_map = PlacedRowMap.of(placed.placement, ctx.filled_WE, ctx.capacity, ctx.rank)
        experts = PlacedExperts(ctx.experts.compute, placed, row_map, ctx.rank)
        return ScheduleOutput(run_placed(dispatched_ECM, experts, ctx.groups, ctx.timing), row_map.rank_tokens)
