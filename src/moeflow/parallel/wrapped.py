"""A schedule that runs another one: FasterMoE's shadowing and EPLB's slots change what is
exchanged and computed around their inner schedule and leave its plans, model and placement rule
alone, so every other protocol member is the inner schedule's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.core.stats import PipelineTiming
from moeflow.parallel.context import Prepared, RunContext, ScheduleOutput
from moeflow.parallel.direct_path import DirectPath
from moeflow.parallel.inference_hook import InferenceHook
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.schedules import ParallelSchedule
from moeflow.parallel.token_share import TokenShare
from moeflow.perf import CostModel
from moeflow.perf.pipeline import PlanPrediction
from moeflow.perf.schedule_models import Plan, ScheduleModel
from moeflow.perf.shape import RegionShape


@dataclass(frozen=True)
class WrappingSchedule:
    inner: ParallelSchedule

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def takes_ragged(self) -> bool:
        return self.inner.takes_ragged

    @property
    def takes_r(self) -> bool:
        return self.inner.takes_r

    @property
    def model(self) -> ScheduleModel:
        return self.inner.model

    @property
    def hook(self) -> InferenceHook | None:
        return self.inner.hook

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return self.inner.placement(num_experts, world_size, hidden_dim)

    def direct_path(self, placement: ExpertPlacement, rank: int) -> DirectPath | None:
        """The inner schedule's on a rank that holds every expert (nothing travels, so there is no
        load to balance); none where tokens travel, which is what the wrapper's technique reshapes
        (shadowing, slots) and what the user turned it on for."""
        path = self.inner.direct_path(placement, rank)
        return path if path is DirectPath.LOCAL else None

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]:
        return self.inner.candidates(shape, degrees, algorithms, cost)

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        return self.inner.predict(plan, cost, shape, backward)

    def token_share(
        self, plan: Plan, groups: ParallelGroups, num_experts: int, timing: PipelineTiming
    ) -> TokenShare:
        return self.inner.token_share(plan, groups, num_experts, timing)

    def plan_label(self, plan: Plan) -> str:
        return self.inner.plan_label(plan)

    def plan_space(
        self, degree_policy: int | str, algorithms: tuple[str, ...], cost_model: CostModel | None
    ) -> tuple[int | str, tuple[str, ...], CostModel | None]:
        return self.inner.plan_space(degree_policy, algorithms, cost_model)

    def prepare(self, capacity: int, filled_WE: torch.Tensor, placement: ExpertPlacement, rank: int) -> Prepared:
        return self.inner.prepare(capacity, filled_WE, placement, rank)

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        return self.inner.run(plan, dispatched_ECM, ctx)
