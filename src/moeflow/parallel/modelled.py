"""The parts every schedule shares: the model half (candidates and predictions from its
``model``) and the defaults of the :class:`~moeflow.parallel.schedules.ParallelSchedule` protocol
that most schedules keep."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.core.stats import PipelineTiming
from moeflow.parallel.context import Prepared
from moeflow.parallel.direct_path import DirectPath
from moeflow.parallel.inference_hook import InferenceHook
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.token_share import ALL_TOKENS, TokenShare
from moeflow.perf import CostModel
from moeflow.perf.pipeline import PlanPrediction
from moeflow.perf.schedule_models import Plan, ScheduleModel
from moeflow.perf.shape import RegionShape


class ModelledSchedule:
    """Mixin for a schedule with a ``model`` property (:class:`moeflow.perf.schedule_models.ScheduleModel`)."""

    name: str
    takes_ragged = False  # whether run() uses the ragged kernel where the layer asks for it
    takes_r = False  # whether a call's r (Tutel's adaptive_r) means something to it

    @property
    def model(self) -> ScheduleModel:
        raise NotImplementedError

    @property
    def hook(self) -> InferenceHook | None:
        """A per-forward placement's scheduler, which sees the routing (Lina's inference); None."""
        return None

    def direct_path(self, placement: ExpertPlacement, rank: int) -> DirectPath | None:
        """``LOCAL`` where ``rank`` holds every expert whole and no hook sees the routing: its
        forward may skip the dispatch and compute its tokens on its own experts
        (:mod:`moeflow.parallel.dispatchers.local`). No other direct path unless the schedule declares one."""
        return DirectPath.LOCAL if self.hook is None and placement.holds_every_expert(rank) else None

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]:
        return self.model.candidates(shape, degrees, algorithms, cost)

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        return self.model.predict(plan, cost, shape, backward)

    def token_share(
        self, plan: Plan, groups: ParallelGroups, num_experts: int, timing: PipelineTiming
    ) -> TokenShare:
        """The tokens this rank encodes and decodes: all it routed, unless the schedule splits them."""
        return ALL_TOKENS

    def plan_label(self, plan: Plan) -> str:
        """The schedule the stats name for a run of ``plan``."""
        return plan.schedule

    def plan_space(
        self, degree_policy: int | str, algorithms: tuple[str, ...], cost_model: CostModel | None
    ) -> tuple[int | str, tuple[str, ...], CostModel | None]:
        """The pipeline policy, all-to-all candidates and cost model its planner searches with."""
        return degree_policy, algorithms, cost_model

    def prepare(self, capacity: int, filled_WE: torch.Tensor, placement: ExpertPlacement, rank: int) -> Prepared:
        """This forward's :class:`~moeflow.parallel.context.Prepared`: the capacity as routed."""
        return Prepared(capacity)
