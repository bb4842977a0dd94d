"""The joint planner: every (schedule, pipeline degree, all-to-all algorithm, shadowing) the cluster
can run, ranked by the simulator. Plans are ranked on a few-layer proxy of the model (layers add up,
except where the gradient all-reduce overlaps the layers below) and the best are re-simulated at
full depth, so a 2,048-rank search takes seconds."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from moeflow.config import switchable_rs
from moeflow.sim.cluster import Cluster
from moeflow.sim.step import StepPlan, StepResult, simulate_step
from moeflow.sim.workload import ModelSpec, routing_loads

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


def algorithms_for(cluster: Cluster) -> list[str]:
    """2DH needs several nodes of several ranks and pairwise several nodes to differ from linear."""
    out = ["linear"]
    if cluster.nodes > 1 and cluster.gpus_per_node > 1:
        out.append("2dh")
    if cluster.nodes > 1:
        out.append("pairwise")
    return out


def parm_plans(cluster: Cluster, model: ModelSpec, space: SearchSpace) -> list[StepPlan]:
    """Behind MP attention: S1 and S2 with experts whole or sharded over the MP group (moeflow's
    layout), and the DeepSpeed-MoE baseline, where the experts divide over the EP ranks; each at
    every pipeline degree."""
    mp, lina = space.mp, space.prioritize_alltoall
    plans = [StepPlan(schedule, degree, mp=mp, esp=esp, prioritize_alltoall=lina)
             for schedule, esp in (("s1", 1), ("s2", 1), ("s1", mp), ("s2", mp), ("ds-baseline", mp))
             for degree in space.degrees]
    if cluster.gpus_per_node % mp:
        raise ValueError(f"--mp {mp} must divide the {cluster.gpus_per_node} GPUs per node (MP groups stay in a node)")
    return [p for p in plans if model.dims.num_experts % (cluster.world_size // p.esp) == 0]


def candidate_plans(cluster: Cluster, model: ModelSpec, space: SearchSpace = SearchSpace()) -> list[StepPlan]:
    """Every plan the search simulates for ``model`` on ``cluster``: each schedule whose layout fits,
    at each pipeline degree, all-to-all algorithm and number of shadowed experts in ``space``."""
    world, num_experts = cluster.world_size, model.dims.num_experts
    if space.mp > 1:
        return parm_plans(cluster, model, space)
    lina = space.prioritize_alltoall
    shadows = [s for s in space.shadowed if s < num_experts] if world > 1 else [0]
    plans: list[StepPlan] = []
    if num_experts % world == 0:
        for degree, algorithm, shadow in itertools.product(space.degrees, algorithms_for(cluster), shadows):
            plans.append(StepPlan("expert", degree, algorithm, prioritize_alltoall=lina, shadowed=shadow))
        if cluster.nodes > 1:
            plans += [StepPlan("smart", prioritize_alltoall=lina, shadowed=s) for s in shadows]
    plans.append(StepPlan("replicated", prioritize_alltoall=lina))
    for r in switchable_rs(num_experts, world):
        if r == 1 and world <= num_experts:
            continue  # r = 1 on whole experts is the expert schedule at d = 1
        plans.append(StepPlan("adaptive", prioritize_alltoall=lina, r=r))
    return plans


def search(cluster: Cluster, model: ModelSpec, training: bool = True, top: int = 5, proxy_layers: int = 2,
           space: SearchSpace = SearchSpace()) -> list[StepResult]:
    """The ``top`` plans, fastest first, simulated at the model's full depth."""
    proxy = model.with_overrides(layers=min(proxy_layers, model.layers))
    proxy_loads = routing_loads(proxy, cluster.world_size)
    ranked = sorted(candidate_plans(cluster, model, space),
                    key=lambda plan: simulate_step(cluster, proxy, plan, training, proxy_loads).step_s)
    loads = routing_loads(model, cluster.world_size)
    finalists = [simulate_step(cluster, model, plan, training, loads) for plan in ranked[:max(top, 1) * 2]]
    return sorted(finalists, key=lambda result: result.step_s)[:top]
