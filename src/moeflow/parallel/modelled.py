"""The model half of a run-half schedule: candidates and predictions come from its ``model``."""

from __future__ import annotations

from collections.abc import Iterable

from moeflow.comm.groups import ParallelGroups
from moeflow.parallel.token_share import ALL_TOKENS, TokenShare
from moeflow.perf import CostModel
from moeflow.perf.pipeline import PlanPrediction, RegionShape
from moeflow.perf.schedules import Plan, ScheduleModel
from moeflow.stats import PipelineTiming


class ModelledSchedule:
    """Mixin for a schedule with a ``model`` property (:class:`moeflow.perf.schedules.ScheduleModel`)."""

    @property
    def model(self) -> ScheduleModel:
        raise NotImplementedError

    def candidates(self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str]) -> list[Plan]:
        return self.model.candidates(shape, degrees, algorithms)

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        return self.model.predict(plan, cost, shape, backward)

    def token_share(
        self, plan: Plan, groups: ParallelGroups, num_experts: int, timing: PipelineTiming
    ) -> TokenShare:
        """The tokens this rank encodes and decodes: all it routed, unless the schedule splits them."""
        return ALL_TOKENS


RAGGED_SCHEDULES = ("expert", "replicated", "packed")
"""The schedules that run whole local experts on their received slots, where the ragged kernel applies."""


def require_ragged_schedule(schedule: str) -> None:
    """Schedules that shard or re-place the experts run the padded kernels only."""
    if schedule not in RAGGED_SCHEDULES:
        raise ValueError(
            f"expert_kernel='ragged' runs with parallel in {RAGGED_SCHEDULES}, not {schedule!r}; "
            "use expert_kernel='bmm'"
        )
