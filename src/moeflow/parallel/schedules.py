"""Parallel schedules: how a dispatched (E, C, M) buffer becomes the combined one.

A schedule owns a placement rule (where the expert weights live), the model half (candidate plans
and their predicted cost, :mod:`moeflow.perf.schedules`) and ``run``. ``MoELayer.forward`` calls
``schedule.run`` between encode and decode; a new technique is a new schedule, not a new path
through the layer.

- :class:`ExpertParallelSchedule`: experts split over the group; tokens travel by all-to-all,
  pipelined over capacity chunks with the planned algorithm, or over FasterMoE's pairwise steps
  (a smart plan, :mod:`moeflow.parallel.smart`).
- :class:`ReplicatedSchedule`: every rank holds every expert and runs them on its own tokens; no
  all-to-all. Its expert gradients are those of the rank's own tokens, summed by the trainer's
  gradient all-reduce like any replicated parameter.
- :class:`PackedSchedule`: Lina's expert packing, expert parallelism inside blocks of ranks that
  each hold every expert (set by the trainer's packer, not chosen at build time).
- :class:`~moeflow.parallel.adaptive.AdaptiveSchedule`: Tutel's switchable parallelism, r chosen per
  iteration on one sharded storage layout (r = 0 gathers the weights instead of moving tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.config import PARM_SCHEDULES, MoEConfig
from moeflow.experts import ExpertCompute, ExpertSlots
from moeflow.parallel.adaptive import AdaptiveSchedule
from moeflow.parallel.modelled import ModelledSchedule
from moeflow.parallel.parm import BaselineSchedule, ParmSchedule
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.smart import smart_experts
from moeflow.parallel.token_share import TokenShare
from moeflow.perf import CostModel
from moeflow.perf.pipeline import PlanPrediction, RegionShape
from moeflow.perf.schedules import LOCAL, SCHEDULE_MODELS, SMART, Plan, ScheduleModel, rank_schedule_plans
from moeflow.pipeline import ExpertExchange, pipelined_experts
from moeflow.stats import PipelineTiming
from moeflow.workspace import Workspace


class ParallelSchedule(Protocol):
    name: str

    @property
    def model(self) -> ScheduleModel:
        """The model half: candidates and their predicted cost (what the planner ranks)."""
        ...

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement: ...

    def candidates(self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str]) -> list[Plan]: ...

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction: ...

    def token_share(
        self, plan: Plan, groups: ParallelGroups, num_experts: int, timing: PipelineTiming
    ) -> TokenShare:
        """Which routed tokens this rank encodes, sends and decodes under ``plan``."""
        ...

    def run(
        self, plan: Plan, dispatched_ECM: torch.Tensor, experts: ExpertSlots, groups: ParallelGroups,
        timing: PipelineTiming, workspace: Workspace | None = None,
        expert_compute: ExpertCompute | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class _ModelledSchedule(ModelledSchedule):
    """Candidates and predictions come from the schedule's numpy model of the same name."""

    name: str

    @property
    def model(self) -> ScheduleModel:
        return SCHEDULE_MODELS[self.name]

    def run(
        self, plan: Plan, dispatched_ECM: torch.Tensor, experts: ExpertSlots, groups: ParallelGroups,
        timing: PipelineTiming, workspace: Workspace | None = None,
        expert_compute: ExpertCompute | None = None,
    ) -> torch.Tensor:
        """The pipelined experts, with this schedule's way of moving chunks; ``expert_compute``
        replaces the experts' own for this call (the ragged kernel with its filled counts)."""
        route = self.exchange(plan, experts, groups)
        compute = experts.compute if expert_compute is None else expert_compute
        return pipelined_experts(dispatched_ECM, compute, experts.weights(), route, plan.degree, timing, workspace)

    def exchange(self, plan: Plan, experts: ExpertSlots, groups: ParallelGroups) -> ExpertExchange:
        raise NotImplementedError


@dataclass(frozen=True)
class ExpertParallelSchedule(_ModelledSchedule):
    name: str = "expert"

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return ExpertPlacement.expert_parallel(num_experts, world_size, hidden_dim)

    def exchange(self, plan: Plan, experts: ExpertSlots, groups: ParallelGroups) -> ExpertExchange:
        return ExpertExchange(groups, plan.algorithm, experts.num_experts)  # all-to-all over the group

    def run(
        self, plan: Plan, dispatched_ECM: torch.Tensor, experts: ExpertSlots, groups: ParallelGroups,
        timing: PipelineTiming, workspace: Workspace | None = None,
        expert_compute: ExpertCompute | None = None,
    ) -> torch.Tensor:
        """The capacity-chunk pipeline, or FasterMoE's pairwise steps for a smart plan."""
        if plan.schedule != SMART:
            return super().run(plan, dispatched_ECM, experts, groups, timing, workspace, expert_compute)
        compute = experts.compute if expert_compute is None else expert_compute
        return smart_experts(dispatched_ECM, compute, experts.weights(), groups, timing, workspace)


@dataclass(frozen=True)
class ReplicatedSchedule(_ModelledSchedule):
    name: str = "replicated"

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return ExpertPlacement.replicated(num_experts, world_size, hidden_dim)

    def exchange(self, plan: Plan, experts: ExpertSlots, groups: ParallelGroups) -> ExpertExchange:
        return ExpertExchange(None, LOCAL, experts.num_experts)  # tokens stay: only the chunking


@dataclass(frozen=True)
class PackedSchedule(_ModelledSchedule):
    """Lina's expert packing (§4.2): expert parallelism inside each block of ``group_size``
    consecutive ranks, every block holding all experts (:meth:`ExpertPlacement.packed`). Tokens
    travel by all-to-all within the block only; the blocks' copies of an expert average their
    gradients like a replicated weight. The planner prices it as an expert-parallel exchange."""

    name: str = "packed"
    group_size: int = 1

    @property
    def model(self) -> ScheduleModel:
        return SCHEDULE_MODELS["expert"]

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return ExpertPlacement.packed(num_experts, world_size, self.group_size, hidden_dim)

    def exchange(self, plan: Plan, experts: ExpertSlots, groups: ParallelGroups) -> ExpertExchange:
        return ExpertExchange(groups.packed(self.group_size), plan.algorithm, experts.num_experts)


def packed_schedule(group_size: int, world_size: int) -> ParallelSchedule:
    """The schedule of blocks of ``group_size`` ranks: expert parallelism itself when the block is
    the whole group."""
    return ExpertParallelSchedule() if group_size == world_size else PackedSchedule(group_size=group_size)


def check_packing(config: MoEConfig, schedule: str, world_size: int, experts_per_rank: int) -> None:
    """Packing re-places an expert-parallel layer: ``experts_per_rank`` must be a multiple of E / W
    that divides E, and no technique that places experts its own way may run beside it."""
    least = config.num_experts // world_size
    if schedule not in ("expert", "packed") or world_size > config.num_experts:
        raise ValueError(f"expert packing re-places the expert-parallel schedule with W <= E; this layer runs "
                         f"parallel={schedule!r} on {world_size} ranks: use parallel='expert'")
    if experts_per_rank < least or config.num_experts % experts_per_rank or world_size % (
            config.num_experts // experts_per_rank):
        raise ValueError(f"experts_per_rank={experts_per_rank} cannot pack {config.num_experts} experts on "
                         f"{world_size} ranks: use a multiple of {least} that divides {config.num_experts}")
    others = {"shadowing": config.shadowing != "off", "redundant_experts": config.redundant_experts > 0,
              "topology_gate": config.topology_gate != "off", "pipeline='smart'": config.pipeline == SMART,
              "alltoall": config.alltoall not in ("auto", "linear")}
    if clash := [name for name, on in others.items() if on]:
        raise ValueError(f"expert packing moves the experts itself and runs the linear all-to-all; turn off "
                         f"{', '.join(clash)} (alltoall 'auto' or 'linear')")


SCHEDULES: dict[str, ParallelSchedule] = {
    "expert": ExpertParallelSchedule(), "replicated": ReplicatedSchedule(), "adaptive": AdaptiveSchedule(),
}


@dataclass(frozen=True)
class ScheduleChoice:
    schedule: ParallelSchedule
    reason: str  # "forced", "default" (no profile or token hint), "layout" (W > E) or "model"


def select_schedule(
    parallel: str | int, num_experts: int, world_size: int, cost_model: CostModel | None, shape: RegionShape | None,
    algorithms: tuple[str, ...], pipeline: int | str = "auto", mp_size: int = 1,
) -> ScheduleChoice:
    """The layer's schedule, fixed when it is built because it decides where the weights live.

    ``auto`` ranks the schedules for a training step (forward, backward and the gradient sync each
    choice costs) at the expected shape. Expert parallelism is priced unpipelined (or at a forced
    degree): the overlap the model promises is what it gets wrong on the 2-core testbed (it put
    d=10-16 first where d=2 ran fastest), and the online planner can still pipeline afterwards.
    Without a profile or a token hint it keeps expert parallelism, which holds the fewest weights
    per rank (and whose placement explains what to do when E is not divisible by the group size).
    With more ranks than experts (a multiple of them) only Tutel's switchable layout fits: ``auto``
    is ``adaptive`` there. An int is Tutel's r, fixed. Parm's schedules run behind tensor-parallel
    attention of ``mp_size`` ranks; behind it ``auto`` is Parm: S1 or S2 chosen per iteration."""
    if isinstance(parallel, int):
        return ScheduleChoice(AdaptiveSchedule(parallel), "forced")
    if parallel == "ds-baseline":
        return ScheduleChoice(BaselineSchedule(mp_size), "forced")
    if parallel in PARM_SCHEDULES:
        return ScheduleChoice(ParmSchedule(mp_size, parallel), "forced")
    if parallel == "auto" and mp_size > 1:
        return ScheduleChoice(ParmSchedule(mp_size, "parm"), "mp_group")
    if parallel != "auto":
        return ScheduleChoice(SCHEDULES[parallel], "forced")
    if world_size > num_experts and world_size % num_experts == 0:
        return ScheduleChoice(SCHEDULES["adaptive"], "layout")
    if world_size == 1 or num_experts % world_size or cost_model is None or shape is None:
        return ScheduleChoice(SCHEDULES["expert"], "default")
    degrees = (pipeline,) if isinstance(pipeline, int) else (1,)
    ranked = rank_schedule_plans(cost_model, shape, tuple(SCHEDULES), degrees, algorithms, backward=True)
    return ScheduleChoice(SCHEDULES[ranked[0][0].placement_schedule], "model")
