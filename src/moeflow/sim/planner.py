"""The joint planner: every (expert group size, schedule, pipeline degree, all-to-all algorithm,
shadowing) the cluster can run, ranked by the simulator. The layout is the expert-parallel group
size EP (experts over EP consecutive ranks, copied over world / EP data-parallel replicas) and,
behind ``mp``, the tensor-parallel attention group. Plans are ranked on a few-layer proxy of the
model (layers add up, except where the gradient all-reduce overlaps the layers below) and the best
are re-simulated at full depth, so a 2,048-rank search takes seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moeflow.config import EXACT_WIRE, GRADIENT_BUCKET_MB
from moeflow.parallel.registry import FEATURE_SPECS, SIMULATED
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.technique import PlanSpace
from moeflow.perf.sim.workload import LayerLoad, ModelSpec, routing_loads
from moeflow.sim.step import WIRE_FEATURE, StepResult, sends_wire, simulate_step

DEGREES = (1, 2, 4, 8)
"""The pipeline degrees the plan search tries."""
SHADOWED = (0, 1, 2, 4)
"""The numbers of shadowed experts the plan search tries."""


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose from."""

    degrees: tuple[int, ...] = DEGREES
    shadowed: tuple[int, ...] = SHADOWED
    prioritize_alltoall: bool = False
    mp: int = 1  # > 1: attention is tensor-parallel over this many ranks, so Parm's schedules run
    ep_sizes: tuple[int, ...] = ()  # the expert group sizes to try; (): every size that tiles the nodes
    wire_dtype: str = EXACT_WIRE  # the run's wire format: plans whose exchange carries it are priced in it


def algorithms_for(cluster: Cluster) -> list[str]:
    """2DH needs several nodes of several ranks and pairwise several nodes to differ from linear."""
    out = ["linear"]
    if cluster.nodes > 1 and cluster.gpus_per_node > 1:
        out.append("2dh")
    if cluster.nodes > 1:
        out.append("pairwise")
    return out


def expert_group_sizes(cluster: Cluster) -> list[int]:
    """The expert-parallel group sizes the layout search tries: every size that tiles the nodes
    (divides a node, or spans whole ones), largest first (every rank: plain expert parallelism)."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    return sorted((ep for ep in range(1, world + 1) if world % ep == 0 and (per_node % ep == 0 or ep % per_node == 0)),
                  reverse=True)


def candidate_plans(cluster: Cluster, model: ModelSpec, space: SearchSpace = SearchSpace()) -> list[StepPlan]:
    """Every plan the search simulates for ``model`` on ``cluster``: for each expert group size
    (:func:`expert_group_sizes`, or ``space.ep_sizes``), each simulated technique's own plans (its
    record's) on one group's ranks, behind tensor-parallel attention when ``space.mp`` > 1 and
    beside it otherwise, at the pipeline degrees, all-to-all algorithms and shadowed experts in
    ``space``. Schedules that hold every expert on every rank run over the world only."""
    if space.mp > 1 and cluster.gpus_per_node % space.mp:
        raise ValueError(f"--mp {space.mp} must divide the {cluster.gpus_per_node} GPUs per node "
                         "(MP groups stay in a node)")
    tiling = expert_group_sizes(cluster)
    sizes = space.ep_sizes or tiling
    bad = [ep for ep in sizes if ep not in tiling]
    if bad:
        raise ValueError(f"ep sizes {bad} do not tile the {cluster.nodes} x {cluster.gpus_per_node} cluster; "
                         f"use some of {tiling}")
    plans = []
    for ep in sizes:
        if space.mp > 1 and ep % space.mp:
            continue  # an MP group lies inside one expert group
        group = cluster.expert_group(ep)
        plans += [plan if ep == cluster.world_size else replace(plan, ep=ep)
                  for plan in _group_plans(group, model, space, whole_world=ep == cluster.world_size)]
    if space.wire_dtype != EXACT_WIRE:  # the run sends its rows so: only the schedules that carry it remain
        plans = [replace(plan, wire_dtype=space.wire_dtype) for plan in plans if sends_wire(plan.schedule)]
        if not plans:
            carriers = ", ".join(FEATURE_SPECS[WIRE_FEATURE].runs_on)
            raise ValueError(f"wire_dtype={space.wire_dtype!r} is sent by {carriers} only, and none of them runs "
                             f"here (mp {space.mp}): use wire_dtype='exact'")
    return sorted(plans, key=lambda plan: plan.esp)  # behind MP: whole experts first, then sharded


def _group_plans(group: Cluster, model: ModelSpec, space: SearchSpace, whole_world: bool) -> list[StepPlan]:
    """Each technique's plans on one expert group's ranks."""
    world, num_experts = group.world_size, model.dims.num_experts
    shadows = tuple(s for s in space.shadowed if s < num_experts) if world > 1 else (0,)
    degrees = space.degrees if world > 1 else (1,)  # nothing travels: nothing to pipeline
    plan_space = PlanSpace(group, model, degrees, tuple(algorithms_for(group)), shadows,
                           space.prioritize_alltoall, space.mp)
    behind = space.mp > 1
    plans = [plan for name, spec in SIMULATED.items()
             if spec.behind_model_parallel == behind and (whole_world or not spec.replicates_experts)
             for plan in spec.simulated.plans(name, plan_space)]
    return plans if world > 1 else plans[:1]  # on one rank every schedule runs alike: its experts at home


def search(cluster: Cluster, model: ModelSpec, training: bool = True, top: int = 5, proxy_layers: int = 2,
           space: SearchSpace = SearchSpace()) -> list[StepResult]:
    """The ``top`` plans, fastest first, simulated at the model's full depth."""
    proxy = model.with_overrides(layers=min(proxy_layers, model.layers))
    proxy_loads, loads = _Loads(proxy), _Loads(model)

    def proxy_time(plan: StepPlan) -> float:
        return simulate_step(cluster, proxy, plan, training, proxy_loads.of(cluster, plan)).step_s

    candidates = candidate_plans(cluster, model, space)
    if not candidates:
        layout = f"{cluster.nodes} x {cluster.gpus_per_node}"
        raise ValueError(f"no plan fits {model.dims.num_experts} experts on the {layout} cluster with mp {space.mp} "
                         f"and expert group sizes {list(space.ep_sizes) or 'any'}: an expert group holds whole MP "
                         "groups and its experts must divide over it (change --ep-size, --mp or the experts)")
    ranked = sorted(candidates, key=proxy_time)
    finalists = [simulate_step(cluster, model, variant, training, loads.of(cluster, variant))
                 for plan in ranked[:max(top, 1) * 2] for variant in gradient_sync_variants(plan, training)]
    return sorted(finalists, key=lambda result: result.step_s)[:top]


def gradient_sync_variants(plan: StepPlan, training: bool = True) -> list[StepPlan]:
    """``plan`` under each way ``moeflow train`` all-reduces the gradients (``grad_sync``): after the
    backward, or in DDP's buckets during it; a plan that prioritizes the all-to-all is Lina's own."""
    if plan.prioritize_alltoall or not training:
        return [plan]
    return [replace(plan, bucket_mb=math.inf), replace(plan, bucket_mb=GRADIENT_BUCKET_MB)]


@dataclass
class _Loads:
    """One model's routing loads per expert group size, drawn once."""

    model: ModelSpec
    drawn: dict[int, list[LayerLoad]] = field(default_factory=dict)

    def of(self, cluster: Cluster, plan: StepPlan) -> list[LayerLoad]:
        ranks = plan.ep or cluster.world_size
        if ranks not in self.drawn:
            self.drawn[ranks] = routing_loads(self.model, ranks)
        return self.drawn[ranks]
