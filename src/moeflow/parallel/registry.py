"""The one registry of moeflow's parallel techniques.

Every technique declares one record here, and everything that lists or checks techniques derives
from these records: the ``parallel`` choices, the CLI's, the schedules ``parallel='auto'`` ranks,
the ragged kernel's schedules, the simulator's modes and regions, and :func:`check_techniques`,
the one check of which techniques combine (the layer, the trainer before it spawns workers,
packing and inference scheduling all call it).

Two kinds of record:

- a :class:`ScheduleSpec` is chosen by the layer's ``parallel`` setting and decides where the
  expert weights live: its run class (which carries its cost model, ``schedule.model``), its
  simulated expert region, and whether it runs behind tensor-parallel attention;
- a :class:`FeatureSpec` is turned on beside a schedule (a wrapping schedule, a gate, a placement
  change, a kernel): the schedules it runs on and the features it cannot run beside.

Adding a technique is its module plus one record below (the docs' recipe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from moeflow.config import DEDUP, EXACT_WIRE, RAGGED, SAA, MoEConfig
from moeflow.parallel.records import (
    FeatureSpec,
    ScheduleSpec,
    ShardingLayout,
    SimulatedSpec,
    check_unique_names,
    installed_records,
)
from moeflow.perf import CostModel
from moeflow.perf.schedule_models import SMART, rank_schedule_plans
from moeflow.perf.shape import RegionShape
from moeflow.perf.sim import parm_regions, regions

if TYPE_CHECKING:
    from moeflow.parallel.schedules import ParallelSchedule

AUTO = "auto"
"""The ``parallel`` setting that lets moeflow choose the schedule."""
PARM_AUTO = "parm"
"""The schedule ``parallel='auto'`` runs behind tensor-parallel attention: Parm's S1 or S2, chosen per iteration."""


def _expert(layout: ShardingLayout) -> ParallelSchedule:
    from moeflow.parallel.schedules import ExpertParallelSchedule
    return ExpertParallelSchedule(token_exchange=layout.token_exchange, dedup_candidate=layout.dedup_candidate)


def _replicated(layout: ShardingLayout) -> ParallelSchedule:
    from moeflow.parallel.schedules import ReplicatedSchedule
    return ReplicatedSchedule()


def _adaptive(layout: ShardingLayout, r: int | None = None) -> ParallelSchedule:
    from moeflow.parallel.adaptive import AdaptiveSchedule
    return AdaptiveSchedule(r)


def _parm(name: str) -> Callable[[ShardingLayout], ParallelSchedule]:
    def make(layout: ShardingLayout) -> ParallelSchedule:
        from moeflow.parallel.parm import ParmSchedule
        return ParmSchedule(layout.mp_size, name, layout.esp_size)
    return make


def _baseline(layout: ShardingLayout) -> ParallelSchedule:
    from moeflow.parallel.parm import BaselineSchedule
    return BaselineSchedule(layout.mp_size)


BUILTIN_SCHEDULES: tuple[ScheduleSpec, ...] = (
    ScheduleSpec("expert", "Tutel/PipeMoE: expert parallelism, pipelined", _expert, regions.EXPERT,
                 takes_ragged=True, ranked_by_auto=True),
    ScheduleSpec("replicated", "every expert on every rank (data parallel)", _replicated, regions.REPLICATED,
                 takes_ragged=True, ranked_by_auto=True, replicates_experts=True),
    ScheduleSpec("adaptive", "Tutel §3.1: switchable parallelism, r per iteration", _adaptive, regions.ADAPTIVE,
                 ranked_by_auto=True, takes_r=True),
    ScheduleSpec("s1", "Parm §III-B: schedule S1", _parm("s1"), parm_regions.S1, behind_model_parallel=True),
    ScheduleSpec("s2", "Parm §III-B: schedule S2", _parm("s2"), parm_regions.S2, behind_model_parallel=True),
    ScheduleSpec("ds-baseline", "Parm's baseline: DeepSpeed-MoE's MP+EP+ESP", _baseline, parm_regions.BASELINE,
                 behind_model_parallel=True),
)
"""moeflow's own schedules, one record each."""
INSTALLED = installed_records()
"""The records other packages install (:mod:`moeflow.parallel.records`), read once."""
SCHEDULES = (*BUILTIN_SCHEDULES, *(record for record in INSTALLED if isinstance(record, ScheduleSpec)))
"""Every schedule the ``parallel`` setting names, one record each."""
DEFAULT_SCHEDULE = "expert"
"""The plain expert-parallel schedule: what ``auto`` keeps without a profile (the fewest weights per rank)."""
SWITCHABLE_SCHEDULE = "adaptive"
"""What an int ``parallel`` (Tutel's r) runs, and what ``auto`` runs with more ranks than experts."""
ONE_RANK_SCHEDULE = "replicated"
"""What every schedule is on one rank (nothing travels): the simulator runs its region there."""
SCHEDULE_SPECS = MappingProxyType({spec.name: spec for spec in SCHEDULES})
"""The schedule records by name."""
PARALLEL_SCHEDULES = tuple(SCHEDULE_SPECS)
"""The schedules' names."""
PARALLEL_CHOICES = (AUTO, *PARALLEL_SCHEDULES)
"""The ``parallel`` setting's names (it also takes Tutel's r, an int)."""
MODEL_PARALLEL_SCHEDULES = tuple(spec.name for spec in SCHEDULES if spec.behind_model_parallel)
"""The schedules that run behind tensor-parallel attention (they need an ``mp_group``)."""
RAGGED_SCHEDULES = tuple(spec.name for spec in SCHEDULES if spec.takes_ragged)
"""The ``parallel`` choices that run whole local experts on their received slots (the ragged kernel)."""

_EXPERT = ("expert",)
BUILTIN_FEATURES: tuple[FeatureSpec, ...] = (
    FeatureSpec("shadowing", "FasterMoE §4.1: dynamic shadowing",
                "replicates hot experts of the expert-parallel schedule", "shadowing='off'", _EXPERT,
                lambda c: c.shadowing != "off"),
    FeatureSpec("topology_gate", "FasterMoE §4.3: topology-aware gate",
                "limits the tokens the expert-parallel schedule sends across nodes", "topology_gate='off'", _EXPERT,
                lambda c: c.topology_gate != "off"),
    FeatureSpec("pipeline='smart'", "FasterMoE §4.2: smart fine-grained schedule",
                "runs FasterMoE's pairwise steps of the expert-parallel schedule", "pipeline='auto'", _EXPERT,
                lambda c: c.pipeline == SMART, simulated=regions.SMART, simulated_as=SMART),
    FeatureSpec("redundant_experts", "EPLB: redundant expert slots", "adds slots to the expert-parallel schedule",
                "redundant_experts=0", _EXPERT, lambda c: c.redundant_experts > 0 and c.balance != AUTO,
                excludes=("shadowing", "topology_gate")),
    FeatureSpec("balance='auto'", "moeflow: off, shadowing or EPLB's slots, per layer, by the cost model",
                "chooses the expert-parallel schedule's load balancing (shadowing or redundant_experts' slots) from "
                "the recorded load", "balance='fixed'", _EXPERT, lambda c: c.balance == AUTO,
                excludes=("shadowing", "topology_gate")),
    FeatureSpec("expert_kernel='ragged'", "moeflow: dropless ragged expert kernel",
                f"runs with parallel in {RAGGED_SCHEDULES} (whole local experts on their received slots)",
                "expert_kernel='bmm'", (*RAGGED_SCHEDULES, "packed"), lambda c: c.expert_kernel == "ragged"),
    FeatureSpec("token_exchange='ragged'", "Megatron-Core / DeepEP / Tutel 0.3: a ragged token exchange",
                "sends only the kept rows over the expert-parallel schedule's all-to-all",
                "token_exchange='auto' (ragged where a chunk leaves enough slots empty) or 'padded'",
                _EXPERT, lambda c: c.token_exchange == RAGGED,
                excludes=("pipeline='smart'", "expert packing", "inference scheduling")),
    FeatureSpec("token_exchange='dedup'", "DeepEP: a token crosses to each rank once",
                "sends a token once to each rank of the expert-parallel schedule's all-to-all, whatever number of "
                "its k experts the rank holds", "token_exchange='ragged' or 'auto'", _EXPERT,
                lambda c: c.token_exchange == DEDUP,
                excludes=("pipeline='smart'", "expert packing", "inference scheduling", "shadowing",
                          "redundant_experts", "balance='auto'")),
    FeatureSpec("wire_dtype", "DeepEP: low-precision dispatch and combine",
                "sends the exchanged rows and their gradients as bf16, or as fp8 with a scale per row",
                "wire_dtype='exact'", ("expert", "adaptive", "replicated", "packed"),
                lambda c: c.wire_dtype != EXACT_WIRE, excludes=("inference scheduling",)),
    FeatureSpec("alltoall", "Tutel §3.3 / FasterMoE: a fixed all-to-all algorithm",
                "fixes the all-to-all algorithm", "alltoall='auto' or 'linear'", (*PARALLEL_SCHEDULES, PARM_AUTO),
                lambda c: c.alltoall not in (AUTO, "linear", SAA)),
    FeatureSpec("alltoall='saa'", "Parm §III-D: S2's combine overlapped with the MP all-gather",
                "overlaps Parm's S2 combine with the MP all-gather", "alltoall='linear'", ("s2", PARM_AUTO),
                lambda c: c.alltoall == SAA),
    FeatureSpec("esp_size", "Parm §III, Table III: N_ESP independent of N_MP",
                "shards each expert's hidden units over esp_size ranks behind an mp_group", "esp_size=None",
                ("s1", "s2", PARM_AUTO), lambda c: c.esp_size is not None),
    FeatureSpec("expert packing", "Lina §4.2: expert packing",
                "moves the experts itself and runs the linear all-to-all", "expert packing off", ("expert", "packed"),
                excludes=("shadowing", "redundant_experts", "topology_gate", "pipeline='smart'", "alltoall",
                          "balance='auto'")),
    FeatureSpec("inference scheduling", "Lina §5: inference scheduling",
                "places the experts per batch over whole experts", "no inference scheduling", ("expert", "replicated"),
                excludes=("shadowing", "redundant_experts", "topology_gate", "balance='auto'")),
)
"""moeflow's own techniques turned on beside a schedule, one record each."""
FEATURES = (*BUILTIN_FEATURES, *(record for record in INSTALLED if isinstance(record, FeatureSpec)))
"""Every technique turned on beside a schedule, one record each."""
check_unique_names((*SCHEDULES, *FEATURES))
FEATURE_SPECS = MappingProxyType({spec.name: spec for spec in FEATURES})
"""The feature records by name."""
SIMULATED = MappingProxyType({
    name: spec for schedule in SCHEDULES for name, spec in (
        (schedule.name, SimulatedSpec(schedule.simulated, schedule.behind_model_parallel, schedule.replicates_experts,
                                      schedule.takes_r)),
        *((f.simulated_as, SimulatedSpec(f.simulated)) for f in FEATURES
          if f.simulated is not None and f.runs_on[0] == schedule.name))
})
"""The simulator's modes by name: every schedule, each followed by the features that run on it with
a mode of their own (FasterMoE's smart schedule after the expert schedule)."""


def check_parallel(parallel: str | int) -> None:
    """``parallel`` names a registered schedule or ``auto``, or is Tutel's r (an int >= 0)."""
    if isinstance(parallel, str) and parallel in PARALLEL_CHOICES:
        return
    if isinstance(parallel, int) and not isinstance(parallel, bool) and parallel >= 0:
        return
    raise ValueError(
        f"parallel must be one of {', '.join(PARALLEL_CHOICES)} or Tutel's r (an integer >= 0), got {parallel!r}"
    )


def experts_must_divide(parallel: str | int) -> bool:
    """Whether ``parallel`` splits whole experts over the ranks (``auto`` may): every schedule but
    those that hold every expert on every rank."""
    return isinstance(parallel, int) or parallel == AUTO or not SCHEDULE_SPECS[parallel].replicates_experts


def is_switchable(parallel: str | int) -> bool:
    """Whether ``parallel`` may run Tutel's switchable layout (an r, a schedule that takes one, or ``auto``)."""
    return isinstance(parallel, int) or parallel == AUTO or SCHEDULE_SPECS[parallel].takes_r


REPLICATING_SCHEDULES = tuple(spec.name for spec in SCHEDULES if spec.replicates_experts)
"""The schedules that hold every expert on every rank (any number of experts fits)."""


def check_techniques(config: MoEConfig, schedule: str, applied: tuple[str, ...] = ()) -> None:
    """Every feature ``config`` turns on, and those in ``applied``, runs on ``schedule`` (a run
    class's name) and beside the others; else a ValueError naming the setting to change."""
    active = [FEATURE_SPECS[name] for name in applied]  # the one being applied speaks first
    active += [f for f in FEATURES if f.name not in applied and f.enabled is not None and f.enabled(config)]
    for feature in active:
        if schedule not in feature.runs_on:
            raise ValueError(f"{feature.name} {feature.does}; this layer runs parallel={schedule!r}: use "
                             f"parallel={feature.runs_on[0]!r} or {feature.off}")
    for feature in active:
        clash = [other for other in active if other.name in feature.excludes or feature.name in other.excludes]
        if clash:
            names = ", ".join(other.name for other in clash)
            offs = ", ".join(other.off for other in clash)
            raise ValueError(f"{feature.name} {feature.does} and runs without {names}: turn off {names} ({offs}), "
                             f"or {feature.off}")


def dedup_allowed(config: MoEConfig) -> bool:
    """Whether ``token_exchange='auto'`` may plan the dedup exchange: its record runs beside every
    technique ``config`` turns on (the wrappers that refuse it, shadowing and EPLB's slots, say so in
    their records' clash with it)."""
    try:
        check_techniques(dataclasses.replace(config, token_exchange=DEDUP), DEFAULT_SCHEDULE)
    except ValueError:
        return False
    return True


def expected_schedule(parallel: str | int, num_experts: int, world_size: int, mp_size: int = 1) -> str:
    """The run class's name the layer builds for ``parallel`` without a cost model (what a
    launcher checks its settings against before the workers exist)."""
    if isinstance(parallel, int):
        return SWITCHABLE_SCHEDULE
    if parallel != AUTO:
        return parallel
    if mp_size > 1:
        return PARM_AUTO
    return SWITCHABLE_SCHEDULE if world_size > num_experts and world_size % num_experts == 0 else DEFAULT_SCHEDULE


@dataclass(frozen=True)
class ScheduleChoice:
    """The schedule :func:`select_schedule` chose, and why."""

    schedule: ParallelSchedule
    reason: str  # "forced", "default" (no profile or token hint), "layout" (W > E), "model" or "mp_group"


def select_schedule(
    parallel: str | int, num_experts: int, world_size: int, cost_model: CostModel | None, shape: RegionShape | None,
    algorithms: tuple[str, ...], pipeline: int | str = AUTO, layout: ShardingLayout | None = None,
) -> ScheduleChoice:
    """The layer's schedule, fixed when it is built because it decides where the weights live.

    ``auto`` ranks the schedules registered as ``ranked_by_auto`` for a training step (forward,
    backward and the gradient sync each choice costs) at the expected shape. Expert parallelism is
    priced unpipelined (or at a forced degree): the overlap the model promises is what it gets
    wrong on the 2-core testbed (it put d=10-16 first where d=2 ran fastest), and the online
    planner can still pipeline afterwards. Without a profile or a token hint it keeps expert
    parallelism, which holds the fewest weights per rank (and whose placement explains what to do
    when E is not divisible by the group size). With more ranks than experts (a multiple of them)
    only Tutel's switchable layout fits: ``auto`` is ``adaptive`` there. An int is Tutel's r,
    fixed. Parm's schedules run behind tensor-parallel attention of ``layout.mp_size`` ranks, each
    expert in ``layout.esp_size`` hidden shards (None: N_MP); behind it ``auto`` is Parm: S1 or S2
    chosen per iteration."""
    check_parallel(parallel)
    layout = layout or ShardingLayout()
    if isinstance(parallel, int):
        return ScheduleChoice(_adaptive(layout, parallel), "forced")
    if parallel != AUTO:
        return ScheduleChoice(SCHEDULE_SPECS[parallel].make(layout), "forced")
    if layout.mp_size > 1:
        return ScheduleChoice(_parm(PARM_AUTO)(layout), "mp_group")
    default = expected_schedule(parallel, num_experts, world_size)
    unpriced = cost_model is None or shape is None
    if default != DEFAULT_SCHEDULE or world_size == 1 or num_experts % world_size or unpriced:
        reason = "layout" if default != DEFAULT_SCHEDULE else "default"
        return ScheduleChoice(SCHEDULE_SPECS[default].make(layout), reason)
    degrees = (pipeline,) if isinstance(pipeline, int) else (1,)
    ranked_specs = {spec.name: spec for spec in SCHEDULES if spec.ranked_by_auto}
    models = tuple(spec.make(layout).model for spec in ranked_specs.values())
    ranked = rank_schedule_plans(cost_model, shape, models, degrees, algorithms, backward=True)
    return ScheduleChoice(ranked_specs[ranked[0][0].placement_schedule].make(layout), "model")
