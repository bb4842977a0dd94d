"""The model half of each parallel schedule: which plans it can run and what each costs.

A :class:`Plan` is (schedule, pipeline degree, all-to-all algorithm). Each schedule's model lists
its candidates for a region shape and predicts their seconds on a calibrated :class:`CostModel`,
so the planner ranks the plans of every schedule with one cost model. Plain math; the run half
lives in :mod:`moeflow.parallel.schedules`.

- ``expert``: expert parallelism, PipeMoE's recurrences (:func:`moeflow.perf.pipeline.predict_plan`).
- ``replicated``: every rank runs every expert on its own tokens; no all-to-all, but in training the
  trainer all-reduces the expert gradients (E experts' parameters), and every rank holds E experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from moeflow.perf.cost import CostModel
from moeflow.perf.pipeline import PlanPrediction, RegionShape, predict_plan, usable_degrees

LOCAL = "none"  # the algorithm of a plan that sends nothing


@dataclass(frozen=True, order=True)
class Plan:
    """What one forward runs: the schedule, the pipeline degree and the all-to-all algorithm."""

    schedule: str
    degree: int
    algorithm: str


class ScheduleModel(Protocol):
    name: str

    def can_predict(self, cost: CostModel) -> bool: ...

    def candidates(self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str]) -> list[Plan]: ...

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction: ...


@dataclass(frozen=True)
class ExpertParallelModel:
    name: str = "expert"

    def can_predict(self, cost: CostModel) -> bool:
        return "gemm" in cost.profile.fits and any(f.startswith("alltoall.") for f in cost.profile.fits)

    def candidates(self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str]) -> list[Plan]:
        usable = usable_degrees(degrees, shape.capacity)
        return [Plan(self.name, d, a) for a in algorithms for d in usable]

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        return predict_plan(cost, shape, plan.degree, plan.algorithm, backward)


@dataclass(frozen=True)
class ReplicatedModel:
    name: str = "replicated"

    def can_predict(self, cost: CostModel) -> bool:
        """Its training cost needs the all-reduce fit (the expert gradients)."""
        return "gemm" in cost.profile.fits and ("allreduce" in cost.profile.fits or cost.world_size == 1)

    def candidates(self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str]) -> list[Plan]:
        return [Plan(self.name, 1, LOCAL)]  # nothing to overlap: chunking would only add overhead

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        rows = shape.capacity  # this rank's own slots of each expert
        t_expert = shape.projections * shape.experts * cost.t_gemm(rows, shape.model_dim, shape.hidden_dim)
        forward = t_expert
        back = 2 * t_expert if backward else 0.0
        expert_bytes = shape.experts * shape.expert_parameters * shape.bytes_per_element
        sync = cost.t_allreduce(expert_bytes) if backward and shape.world_size > 1 else 0.0
        return PlanPrediction(plan.degree, plan.algorithm, forward, back, sync, expert_bytes, self.name)


SCHEDULE_MODELS: dict[str, ScheduleModel] = {"expert": ExpertParallelModel(), "replicated": ReplicatedModel()}


def rank_schedule_plans(
    cost: CostModel, shape: RegionShape, schedules: Iterable[str], degrees: Iterable[int],
    algorithms: Iterable[str], backward: bool,
) -> list[tuple[Plan, PlanPrediction]]:
    """Every candidate of every named schedule the profile can predict, fastest first."""
    degrees = list(degrees)
    ranked = []
    for name in schedules:
        model = SCHEDULE_MODELS[name]
        if not model.can_predict(cost):
            continue
        for plan in model.candidates(shape, degrees, algorithms):
            ranked.append((plan, model.predict(plan, cost, shape, backward)))
    return sorted(ranked, key=lambda item: (item[1].total_s, item[0].degree))
