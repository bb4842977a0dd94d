"""The simulator's half of a technique's record: what ``moeflow simulate`` and ``moeflow plan
--cluster`` need to know of a schedule, declared beside its region and carried by its one record
in :mod:`moeflow.parallel.registry`. Nothing in the simulator tests a schedule's name: it asks the
record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moeflow.perf.sim.builder import Region
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.workload import ModelSpec


@dataclass(frozen=True)
class PlanSpace:
    """What the joint planner searches on one cluster and model: each technique writes its plans
    for it (:attr:`SimulatedSchedule.plans`)."""

    cluster: Cluster
    model: ModelSpec
    degrees: tuple[int, ...]
    algorithms: tuple[str, ...]
    shadowed: tuple[int, ...]  # numbers of shadowed experts that fit this model
    prioritize_alltoall: bool = False
    mp: int = 1  # > 1: attention is tensor-parallel over this many ranks

    @property
    def experts_divide(self) -> bool:
        """Whole experts split evenly over the ranks (what expert parallelism needs)."""
        return self.model.dims.num_experts % self.cluster.world_size == 0


def _no_plans(name: str, space: PlanSpace) -> list[StepPlan]:
    return []


def _any_layout(cluster: Cluster, model: ModelSpec, plan: StepPlan) -> None:
    return None


def _name_only(plan: StepPlan) -> str:
    return plan.schedule


def _all_tokens(plan: StepPlan) -> float:
    return 1.0


def schedule_settings(plan: StepPlan) -> dict[str, Any]:
    """The ``moeflow train`` settings of a plan of a schedule by the same name: the schedule, its
    fixed pipeline degree and all-to-all algorithm."""
    return {"parallel": plan.schedule, "pipeline": plan.degree, "alltoall": plan.algorithm}


@dataclass(frozen=True)
class SimulatedSchedule:
    """How the simulator runs and searches one schedule. ``region`` writes its expert region;
    ``plans(name, space)`` the plans ``moeflow plan --cluster`` tries (none: only named ones run);
    ``check`` refuses a layout the schedule cannot run (a ValueError naming the fix); ``label``
    names a plan; ``gated_share`` is the share of its MP group's tokens a rank gates, encodes and
    decodes; ``settings`` the ``moeflow train`` settings that run the plan's schedule (what
    ``moeflow plan --out`` writes)."""

    region: Region
    plans: Callable[[str, PlanSpace], list[StepPlan]] = _no_plans
    check: Callable[[Cluster, ModelSpec, StepPlan], None] = _any_layout
    label: Callable[[StepPlan], str] = _name_only
    gated_share: Callable[[StepPlan], float] = _all_tokens
    settings: Callable[[StepPlan], dict[str, Any]] = schedule_settings
