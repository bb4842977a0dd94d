"""The joint planner: every (schedule, pipeline degree, all-to-all algorithm, shadowing) the cluster
can run, ranked by the simulator. Plans are ranked on a few-layer proxy of the model (layers add up,
except where the gradient all-reduce overlaps the layers below) and the best are re-simulated at
full depth, so a 2,048-rank search takes seconds."""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.parallel.registry import SIMULATED
from moeflow.sim.cluster import Cluster
from moeflow.sim.plan import StepPlan
from moeflow.sim.step import StepResult, simulate_step
from moeflow.sim.technique import PlanSpace
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


def candidate_plans(cluster: Cluster, model: ModelSpec, space: SearchSpace = SearchSpace()) -> list[StepPlan]:
    """Every plan the search simulates for ``model`` on ``cluster``: each simulated technique's own
    plans (its record's), behind tensor-parallel attention when ``space.mp`` > 1 and beside it
    otherwise, at the pipeline degrees, all-to-all algorithms and shadowed experts in ``space``."""
    world, num_experts = cluster.world_size, model.dims.num_experts
    behind = space.mp > 1
    if behind and cluster.gpus_per_node % space.mp:
        raise ValueError(f"--mp {space.mp} must divide the {cluster.gpus_per_node} GPUs per node "
                         "(MP groups stay in a node)")
    shadows = tuple(s for s in space.shadowed if s < num_experts) if world > 1 else (0,)
    plan_space = PlanSpace(cluster, model, space.degrees, tuple(algorithms_for(cluster)), shadows,
                           space.prioritize_alltoall, space.mp)
    plans = [plan for name, spec in SIMULATED.items() if spec.behind_model_parallel == behind
             for plan in spec.simulated.plans(name, plan_space)]
    return sorted(plans, key=lambda plan: plan.esp)  # behind MP: whole experts first, then sharded


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
