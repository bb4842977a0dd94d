"""One training step (forward, backward, gradient sync, optimizer) or one inference batch of an MoE
transformer, written as a :class:`~moeflow.perf.sim.engine.Timeline` and run.

Per layer: attention, gate and encode on the compute stream (with EPLB's ``redundant_slots``, the
experts' region runs over the slots placed for the layer's load); the dispatch all-to-all of each of d
capacity chunks on the all-to-all stream (issued D1..Dd, then C1..Cd, as moeflow's executor does);
each chunk's experts on the compute stream; the combines; decode. The backward mirrors it with the
device's backward FLOP ratio, then all-reduces the layer's dense gradients on the gradients stream,
where it competes with later layers' all-to-alls for the links (Lina's contention), unless
``prioritize_alltoall`` serves the all-to-all first (Lina's fix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moeflow.config import EXACT_WIRE
from moeflow.parallel.registry import FEATURE_SPECS, FEATURES, ONE_RANK_SCHEDULE, SIMULATED, SimulatedSpec
from moeflow.perf.sim.builder import StepBuilder
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.engine import Timeline
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.workload import LayerLoad, ModelSpec, routing_loads
from moeflow.sim.pipelined import simulate_pipelined

SLOTS_FEATURE = "redundant_experts"
"""The feature record of EPLB's slots (``plan.redundant_slots``): the schedules it runs on are its."""
WIRE_FEATURE = "wire_dtype"
"""The feature record of the wire formats (``plan.wire_dtype``)."""


def run_class(schedule: str) -> str:
    """The layer's schedule a simulated one runs as: its own, or for a technique simulated as a
    schedule of its own (FasterMoE's smart pipeline) the schedule that technique runs on."""
    return next((f.runs_on[0] for f in FEATURES if f.simulated_as == schedule), schedule)


def sends_wire(schedule: str) -> bool:
    """Whether the simulated ``schedule`` runs on a schedule whose exchange carries ``wire_dtype``."""
    return run_class(schedule) in FEATURE_SPECS[WIRE_FEATURE].runs_on


def technique_of(plan: StepPlan) -> SimulatedSpec:
    """The record of the schedule ``plan`` names, once the plan's knobs fit it: mp and esp only
    behind tensor-parallel attention, Tutel's r exactly where the schedule takes one."""
    if plan.schedule not in SIMULATED:
        raise ValueError(f"schedule must be one of {', '.join(SIMULATED)}, got {plan.schedule!r}")
    spec = SIMULATED[plan.schedule]
    if (plan.mp > 1 or plan.esp > 1) and not spec.behind_model_parallel:
        behind = ", ".join(name for name, other in SIMULATED.items() if other.behind_model_parallel)
        raise ValueError(f"mp and esp > 1 go with Parm's schedules ({behind}), not {plan.schedule!r}")
    if spec.takes_r != (plan.r is not None):
        takes = " or ".join(name for name, other in SIMULATED.items() if other.takes_r)
        raise ValueError(f"Tutel's r goes with the {takes} schedule, and the {takes} schedule needs an r")
    return spec


def plan_label(plan: StepPlan) -> str:
    """How reports name ``plan``: its schedule's own label, then the options every schedule shares."""
    spec = technique_of(plan)
    base = spec.simulated.label(plan)
    if spec.behind_model_parallel:
        base += (f" d={plan.degree}" if plan.degree > 1 else "") + f" mp={plan.mp} esp={plan.esp}"
    return base + plan.options_label()


@dataclass
class StepResult:
    """Seconds of the step (the slowest rank), busy seconds per category, dropped assignments."""

    plan: StepPlan
    step_s: float
    busy_s: dict[str, float]
    dropped: float
    operations: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": plan_label(self.plan), "step_ms": round(self.step_s * 1e3, 4),
                "busy_ms": {k: round(v * 1e3, 4) for k, v in sorted(self.busy_s.items())},
                "dropped": self.dropped, "operations": self.operations, **self.extra}


def step_builder(cluster: Cluster, model: ModelSpec, plan: StepPlan, training: bool = True,
                 layer_only: bool = False) -> StepBuilder:
    """The builder of ``plan``'s step, once its schedule's record accepts the layout."""
    spec = technique_of(plan)
    group = expert_group(cluster, plan)
    _check_layout(group, model, plan, spec)
    simulated = spec.simulated if group.world_size > 1 else SIMULATED[ONE_RANK_SCHEDULE].simulated  # nothing travels
    return StepBuilder(group, model, plan, simulated.region, spec.simulated.gated_share(plan),
                       spec.replicates_experts, training, layer_only, world=cluster)


def expert_group(cluster: Cluster, plan: StepPlan) -> Cluster:
    """The ranks one of ``plan``'s expert groups spans (every group runs alike): the cluster itself
    unless the plan names a smaller ``ep``."""
    if plan.ep is None or plan.ep == cluster.world_size:
        return cluster
    if technique_of(plan).replicates_experts:
        raise ValueError(f"ep ({plan.ep}) groups the experts of an expert-parallel schedule; the {plan.schedule} "
                         "schedule holds every expert on every rank: leave ep unset")
    return cluster.expert_group(plan.ep)


def _check_layout(cluster: Cluster, model: ModelSpec, plan: StepPlan, spec: SimulatedSpec) -> None:
    num_experts, world = model.dims.num_experts, cluster.world_size
    spec.simulated.check(cluster, model, plan)
    slots_run_on = FEATURE_SPECS[SLOTS_FEATURE].runs_on
    if plan.redundant_slots and (run_class(plan.schedule) not in slots_run_on or plan.shadowed):
        raise ValueError(f"redundant_slots (EPLB) run on the {' or '.join(slots_run_on)} schedule without shadowing")
    if plan.redundant_slots and (num_experts + plan.redundant_slots) % world:
        raise ValueError(f"the {num_experts} experts + {plan.redundant_slots} redundant slots must split evenly over "
                         f"the {world} ranks")
    if plan.wire_dtype != EXACT_WIRE and not sends_wire(plan.schedule):
        carriers = ", ".join(FEATURE_SPECS[WIRE_FEATURE].runs_on)
        raise ValueError(f"wire_dtype={plan.wire_dtype!r} is sent by the {carriers} schedules; {plan.schedule!r} "
                         "sends exact rows: use wire_dtype='exact'")
    if plan.shadowed >= num_experts:
        raise ValueError(f"shadowed ({plan.shadowed}) must be fewer than the {num_experts} experts")


def simulate_step(cluster: Cluster, model: ModelSpec, plan: StepPlan | None = None, training: bool = True,
                  loads: list[LayerLoad] | None = None, layer_only: bool = False) -> StepResult:
    """Simulate one training step (``training``) or one inference batch; the slowest rank's time.
    ``layer_only``: the MoE layers alone (what a layer benchmark measures). A pipelined plan
    (``pp`` > 1) is priced from one stage's micro-batch (:mod:`moeflow.sim.pipelined`)."""
    plan = plan or StepPlan()
    if plan.pp > 1:
        if not training or layer_only:
            raise ValueError(f"pp={plan.pp} prices a pipelined training step: simulate it with training and the "
                             "whole model, or set pp=1")
        step, layout = simulate_pipelined(cluster, model, plan, loads, stage_timeline)
        return StepResult(plan, step.step_s, step.busy_s, step.dropped, step.operations, step.extra(layout))
    builder = step_builder(cluster, model, plan, training, layer_only)
    loads = routing_loads(model, builder.cluster.world_size) if loads is None else loads
    timeline = builder.build(loads).run()
    dropped = sum(load.dropped(model) for load in loads)
    return StepResult(plan, timeline.makespan(), timeline.busy(), dropped, len(timeline.ops))


def stage_timeline(cluster: Cluster, model: ModelSpec, plan: StepPlan,
                   loads: list[LayerLoad] | None) -> tuple[Timeline, int]:
    """One unpipelined training step of ``plan`` run: its timeline and how many of its operations
    are the forward's (a pipeline stage's micro-batch, :data:`moeflow.sim.pipelined.StageRun`)."""
    builder = step_builder(cluster, model, plan)
    loads = routing_loads(model, builder.cluster.world_size) if loads is None else loads
    return builder.build(loads).run(), builder.forward_ops


def simulated_ms(cluster: Cluster, model: ModelSpec, plan: StepPlan, layer_only: bool = True) -> float:
    """Milliseconds of one simulated training step (by default the MoE layers alone)."""
    return simulate_step(cluster, model, plan, layer_only=layer_only).step_s * 1e3
