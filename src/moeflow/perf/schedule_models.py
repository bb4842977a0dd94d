"""The model half of each parallel schedule: which plans it can run and what each costs.

A :class:`Plan` is (schedule, pipeline degree, all-to-all algorithm). Each schedule's model lists
its candidates for a region shape and predicts their seconds on a calibrated :class:`CostModel`,
so the planner ranks the plans of every schedule with one cost model. Plain math; the run half
lives in :mod:`moeflow.parallel.schedules`.

- ``expert``: expert parallelism, PipeMoE's recurrences (:func:`moeflow.perf.pipeline.predict_plan`).
- ``replicated``: every rank runs every expert on its own tokens; no all-to-all, but in training the
  trainer all-reduces the expert gradients (E experts' parameters), and every rank holds E experts.
- ``adaptive``: Tutel's switchable parallelism (§3.1, Table 4) on one sharded storage layout:
  r = 0 all-gathers the weights (ZeRO-3) and moves no token; r >= 1 sends every token to r hidden
  blocks of its expert, each gathered over g = (W / E) / r ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from moeflow.config import DEDUP, PADDED, RAGGED, dedup_row_share, switchable_rs
from moeflow.perf.cost import CostModel
from moeflow.perf.pipeline import PlanPrediction, chunk_costs, pipeline_makespan, predict_plan, usable_degrees
from moeflow.perf.shape import RegionShape

MIN_GAIN = 0.05
"""The fraction by which a more involved choice (a plan with more chunks, a load-balancing technique
that moves more) must beat the simpler ones to be taken: inside it, measurement and model noise
decide, and the simpler one costs nothing to keep."""
LOCAL = "none"  # the algorithm of a plan that sends nothing
SMART = "smart"
"""FasterMoE's smart schedule (§4.2): a plan of the expert-parallel schedule that pipelines over the
pairwise steps (one per node) instead of capacity chunks (:mod:`moeflow.parallel.smart`)."""
SMART_PLAN_ALGORITHM = "pairwise"


@dataclass(frozen=True, order=True)
class Plan:
    """What one forward runs: the schedule, the pipeline degree, the all-to-all algorithm,
    Tutel's r for the ``adaptive`` schedule (None for the others), and how the tokens travel
    (``padded``: every slot of the capacity; ``ragged``: only the kept rows; ``auto``: ragged where
    a chunk leaves enough slots empty; ``dedup``: the kept rows, a token once to each rank)."""

    schedule: str
    degree: int
    algorithm: str
    r: int | None = None
    exchange: str = PADDED

    @property
    def placement_schedule(self) -> str:
        """The schedule whose placement this plan runs on (a smart plan is the expert schedule's)."""
        return "expert" if self.schedule == SMART else self.schedule


class ScheduleModel(Protocol):
    name: str
    sends_tokens: bool  # whether plans have an all-to-all (and so a degree and algorithm to choose)

    def can_predict(self, cost: CostModel) -> bool: ...

    def forced_plan(self, degree: int, algorithm: str) -> Plan | None:
        """The plan when the degree and algorithm are given, if nothing else is left to choose."""
        ...

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]: ...

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction: ...


@dataclass(frozen=True)
class ExpertParallelModel:
    """Expert parallelism over capacity chunks (and FasterMoE's smart schedule), its tokens sent by
    ``exchange``: padded, ragged, auto (ragged where a chunk leaves enough slots empty) or dedup.
    ``dedup_candidate``: under auto, each plan also as a dedup plan where a cost model prices it and
    a token's k choices share ranks (the planner then ranks and times both)."""

    name: str = "expert"
    sends_tokens: bool = True
    exchange: str = PADDED
    dedup_candidate: bool = False

    def can_predict(self, cost: CostModel) -> bool:
        return "gemm" in cost.profile.fits and any(f.startswith("alltoall.") for f in cost.profile.fits)

    def forced_plan(self, degree: int, algorithm: str) -> Plan | None:
        return Plan(self.name, degree, algorithm, exchange=self.exchange)

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]:
        """Capacity-chunk plans of every (degree, algorithm), and FasterMoE's smart schedule where
        the pairwise exchange it is built on is a candidate (several nodes) and the exchange is not
        forced ragged (its steps send every slot)."""
        algorithms = list(algorithms)
        usable = usable_degrees(degrees, shape.capacity)
        smart = [Plan(SMART, 1, SMART_PLAN_ALGORITHM)] if SMART_PLAN_ALGORITHM in algorithms else []
        smart = smart if self.exchange not in (RAGGED, DEDUP) else []  # its pairwise steps send padded slots
        plans = [Plan(self.name, d, a, exchange=self.exchange) for a in algorithms for d in usable]
        if self.dedup_candidate and cost is not None and dedup_exchange_share(shape) < 1.0:
            plans += [dataclasses.replace(plan, exchange=DEDUP) for plan in plans]
        return plans + smart

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        if plan.schedule == SMART:
            return predict_smart(cost, shape, backward)
        sent = ragged_shape(shape) if plan.exchange != PADDED else shape
        share = dedup_exchange_share(shape) if plan.exchange == DEDUP else 1.0
        return predict_plan(cost, sent, plan.degree, plan.algorithm, backward, row_share=share)


def dedup_exchange_share(shape: RegionShape) -> float:
    """The share of the kept rows a dedup exchange sends each way in ``shape`` (choices spread uniformly)."""
    return dedup_row_share(shape.dims.num_experts, shape.world_size, shape.dims.top_k)


def ragged_shape(shape: RegionShape) -> RegionShape:
    """The region a ragged exchange moves: the kept rows, priced as a balanced load of the rank's
    routed assignments (k T / E per expert; at most the capacity). Where the tokens are unknown,
    the capacity (the padded exchange's bytes: it is never priced cheaper than it may run)."""
    if not shape.tokens:
        return shape
    layer = shape.dims
    mean = -(-layer.top_k * shape.tokens // layer.num_experts)
    return dataclasses.replace(shape, capacity=min(shape.capacity, mean))


def predict_smart(cost: CostModel, shape: RegionShape, backward: bool = True) -> PlanPrediction:
    """FasterMoE's smart schedule as PipeMoE's recurrences over its n pairwise steps (one per node;
    the communication runs every S before any R, as the recurrences assume). A step across nodes
    costs 1 / (n - 1) of the pairwise all-to-all's inter-node steps; step 0 stays in the node: free
    with one rank per node, else the intra-node all-to-all fit (or an equal share when absent).
    Each step computes the local experts on the C slots of each of the node's M ranks."""
    nodes, per_node = cost.profile.nodes, cost.profile.ranks_per_node
    layer = shape.dims
    size = cost.dispatch_bytes(shape)
    whole = cost.t_alltoall(SMART_PLAN_ALGORITHM, size)
    if per_node == 1:
        local, remote = 0.0, whole / max(1, nodes - 1)
    elif "alltoall.intra_node" in cost.profile.fits:
        local = cost.profile.fit("alltoall.intra_node")(size / nodes)
        remote = max(0.0, whole - local) / max(1, nodes - 1)
    else:
        local = remote = whole / nodes
    t_step = [local] + [remote] * (nodes - 1)
    slowdown = cost.profile.interference if nodes > 1 else 1.0
    dims = (per_node * shape.capacity, layer.model_dim, layer.hidden_dim, layer.projections)
    t_expert = [shape.local_experts * cost.t_ffn(*dims) * slowdown] * nodes
    t_back = [shape.local_experts * cost.t_ffn(*dims, backward=True) * slowdown] * nodes
    forward = pipeline_makespan(t_step, t_expert, t_step)
    back = pipeline_makespan(t_step, t_back, t_step) if backward else 0.0
    memory = shape.local_experts * layer.expert_parameters * shape.bytes_per_element
    return PlanPrediction(1, SMART_PLAN_ALGORITHM, forward, back, expert_memory_bytes=memory, schedule=SMART)


@dataclass(frozen=True)
class ReplicatedModel:
    name: str = "replicated"
    sends_tokens: bool = False

    def forced_plan(self, degree: int, algorithm: str) -> Plan | None:
        return Plan(self.name, degree, LOCAL)

    def can_predict(self, cost: CostModel) -> bool:
        """Its training cost needs the all-reduce fit (the expert gradients)."""
        return "gemm" in cost.profile.fits and ("allreduce" in cost.profile.fits or cost.world_size == 1)

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]:
        return [Plan(self.name, 1, LOCAL)]  # nothing to overlap: chunking would only add overhead

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        layer = shape.dims
        dims = (shape.capacity, layer.model_dim, layer.hidden_dim, layer.projections)  # own slots of each expert
        forward = layer.num_experts * cost.t_ffn(*dims)
        back = layer.num_experts * cost.t_ffn(*dims, backward=True) if backward else 0.0
        expert_bytes = layer.num_experts * layer.expert_parameters * shape.bytes_per_element
        sync = cost.t_allreduce(expert_bytes) if backward and shape.world_size > 1 else 0.0
        return PlanPrediction(plan.degree, plan.algorithm, forward, back, sync, expert_bytes, self.name)


@dataclass(frozen=True)
class AdaptiveModel:
    """Tutel §3.1's cost of each r on its one storage layout (Table 4: DP is O(P), EP+DP+MP is
    O(C_g r + P / (E r)) below r = W / E and O(C_g W / E) at it), priced on the calibrated fits:

    - r = 0: all-gather of all E experts over the W ranks before the experts, their gradients
      reduce-scattered after; each rank runs E experts on its own C slots, nothing is sent;
    - r >= 1: the weight all-gather (and gradient reduce-scatter) over g = S / r ranks of an
      H / r hidden block (none at r = S), and the pipeline of :func:`chunk_costs` with r copies
      of every chunk (PipeMoE's recurrence, Eq. 9-12, unchanged).
    The gather sits outside the pipeline, as in Tutel. ``r`` restricts the candidates to one r."""

    name: str = "adaptive"
    r: int | None = None
    sends_tokens: bool = True

    def forced_plan(self, degree: int, algorithm: str) -> Plan | None:
        if self.r is None:
            return None
        return Plan(self.name, 1, LOCAL, 0) if self.r == 0 else Plan(self.name, degree, algorithm, self.r)

    def can_predict(self, cost: CostModel) -> bool:
        fits = cost.profile.fits
        return cost.world_size == 1 or (
            "gemm" in fits and "allgather" in fits and "reducescatter" in fits
            and any(f.startswith("alltoall.") for f in fits)
        )

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]:
        rs = switchable_rs(shape.dims.num_experts, shape.world_size)
        usable = usable_degrees(degrees, shape.capacity)
        plans = []
        for r in rs if self.r is None else (self.r,):
            if r == 0:
                plans.append(Plan(self.name, 1, LOCAL, 0))  # no all-to-all to overlap
            else:
                plans.extend(Plan(self.name, d, a, r) for a in algorithms if a != LOCAL for d in usable)
        return plans

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        r = 1 if plan.r is None else plan.r
        element, layer = shape.bytes_per_element, shape.dims
        if r == 0:
            gathered = layer.num_experts * layer.expert_parameters * element
            dims = (shape.capacity, layer.model_dim, layer.hidden_dim, layer.projections)
            forward = cost.t_allgather(gathered / shape.world_size) + layer.num_experts * cost.t_ffn(*dims)
            back = 0.0
            if backward:
                back = layer.num_experts * cost.t_ffn(*dims, backward=True) + cost.t_reducescatter(gathered)
            return PlanPrediction(plan.degree, plan.algorithm, forward, back, 0.0, gathered, self.name)
        group = shape.hidden_shards // r
        block = shape.local_experts * layer.expert_parameters * element // r  # gathered H / r block
        t_a2a, t_expert, t_back = chunk_costs(cost, shape, plan.degree, plan.algorithm, r)
        forward = cost.t_allgather(block / group, group) + pipeline_makespan(t_a2a, t_expert, t_a2a)
        back = 0.0
        if backward:
            back = pipeline_makespan(t_a2a, t_back, t_a2a) + cost.t_reducescatter(block, group)
        return PlanPrediction(plan.degree, plan.algorithm, forward, back, 0.0, block, self.name)


def rank_schedule_plans(
    cost: CostModel, shape: RegionShape, schedules: Iterable[ScheduleModel], degrees: Iterable[int],
    algorithms: Iterable[str], backward: bool,
) -> list[tuple[Plan, PlanPrediction]]:
    """Every candidate of every schedule model the profile can predict, fastest first."""
    degrees = list(degrees)
    ranked = []
    for schedule in schedules:
        if not schedule.can_predict(cost):
            continue
        for plan in schedule.candidates(shape, degrees, algorithms, cost):
            ranked.append((plan, schedule.predict(plan, cost, shape, backward)))
    return sorted(ranked, key=lambda item: (item[1].total_s, item[0].degree))
