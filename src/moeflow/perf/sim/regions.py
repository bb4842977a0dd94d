"""The expert region of one layer (dispatch, experts, combine) under each parallel schedule, as
operations on a :class:`~moeflow.sim.step.StepBuilder`'s timeline. One function per schedule, as
moeflow's layer has one :class:`ParallelSchedule` per technique:

- ``expert``: expert parallelism, the capacity buffer cut into d chunks (PipeMoE/Tutel pipelining),
  each sent whole or, under a ragged exchange, as its kept rows;
- ``replicated``: every rank runs every expert on its own tokens (no all-to-all);
- ``smart``: FasterMoE's schedule, pipelined over the pairwise steps (one per node);
- ``adaptive``: Tutel's switchable parallelism at its r (0: weights all-gathered, ZeRO-3; r >= 1:
  tokens repeated r times, each hidden block's weights gathered over (W / E) / r ranks).

Each is registered with its technique in :mod:`moeflow.parallel.registry`, which the simulator's
modes come from.

FasterMoE's shadowing wraps any of them: the hottest experts' weights are broadcast, their tokens
stay home, and only the rest travel (their gradients are all-reduced in the backward). Parm's
schedules and their DeepSpeed-MoE baseline live in :mod:`moeflow.perf.sim.parm_regions`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from moeflow.config import check_switchable_layout, switchable_rs, validate_r
from moeflow.perf.pipeline import capacity_chunks
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.engine import ALLTOALL, COMPUTE
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.technique import PlanSpace, SimulatedSchedule
from moeflow.perf.sim.workload import ModelSpec

EXPERT_SCHEDULE = "expert"
"""The schedule FasterMoE's smart pipeline runs on (its feature record's)."""

if TYPE_CHECKING:
    from moeflow.perf.sim.builder import StepBuilder
    from moeflow.perf.sim.network import Step
    from moeflow.perf.sim.workload import LayerLoad


def expert_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    """Dispatch D1..Dd, chunk i's experts after Di, combines C1..Cd (moeflow's executor order);
    under a dedup exchange each sends a token once to each rank."""
    capacity = b.capacity(load)
    bounds = capacity_chunks(capacity, b.plan.degree) or [(0, 0)]
    chunks = [stop - start for start, stop in bounds]
    rows = b.expert_rows(load, capacity, backward)
    pairs = [b.chunk_pair_bytes(load, start, stop) * b.exchange_share for start, stop in bounds]
    dispatched = [b.alltoall(pair, deps) for pair in pairs]
    slowdown = b.device.overlap_slowdown if len(chunks) > 1 else 1.0  # chunks overlap the next dispatch
    computed = [b.timeline.compute(COMPUTE, slowdown * b.ffn_s(rows * (chunk / max(capacity, 1)), backward), [d],
                                   "experts") for chunk, d in zip(chunks, dispatched, strict=True)]
    return [b.alltoall(pair, [c]) for pair, c in zip(pairs, computed, strict=True)]


def replicated_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    rows = b.local_rows(load, b.capacity(load))
    experts = load.counts.shape[1]
    return [b.timeline.compute(COMPUTE, b.ffn_s(rows, backward, local_experts=experts), deps, "experts")]


def smart_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    """S_0..S_{n-1} then R_0..R_{n-1} on the all-to-all stream, step j's experts between: step 0
    is the node's own ranks (intra-node), step j >= 1 one other node's."""
    network, capacity = b.network, b.capacity(load)
    per_node, nodes = b.cluster.gpus_per_node, b.cluster.nodes
    pair = b.pair_bytes(capacity, load.counts.shape[1])
    own = [network.pairwise_intra_step(pair)] if per_node > 1 else []
    exchange = network.scaled("pairwise", own + [network.pairwise_inter_step(pair)] * (nodes - 1))  # one call
    steps: list[Step | None] = ([None] if per_node == 1 else []) + list(exchange)
    rows = b.expert_rows(load, capacity, backward)
    share = 1.0 / nodes  # each step brings one node's tokens
    sent = [b.collective(ALLTOALL, [s] if s is not None else [], deps, "alltoall", b.priority) for s in steps]
    slowdown = b.device.overlap_slowdown if nodes > 1 else 1.0  # step j's experts overlap step j + 1
    computed = [b.timeline.compute(COMPUTE, slowdown * b.ffn_s(rows * share, backward), [s], "experts") for s in sent]
    return [b.collective(ALLTOALL, [s] if s is not None else [], [c], "alltoall", b.priority)
            for s, c in zip(steps, computed, strict=True)]


def adaptive_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    """Tutel's r: r = 0 gathers every expert's weights and moves no token; r >= 1 sends each token
    to r hidden blocks of its expert and gathers each block's weights over g = (W / E) / r ranks.
    The forward gathers (the backward reuses the gathered copy) and the backward reduce-scatters
    the weight gradients over the same group."""
    r, world, m = b.plan.r, b.cluster.world_size, b.model
    num_experts = m.dims.num_experts
    stored = num_experts * m.dims.expert_parameters * m.element_bytes / world  # weight bytes each rank stores
    group = world if r == 0 else max(1, world // num_experts // r)
    network = b.network
    if not backward:
        deps = [b.collective(ALLTOALL, network.allgather(stored, group), deps, "allgather", b.priority)]
    if r == 0:
        done = replicated_region(b, load, deps, backward)
    else:
        capacity = b.capacity(load)
        pair = r * b.pair_bytes(capacity, load.counts.shape[1])
        computed = b.timeline.compute(COMPUTE, b.ffn_s(b.expert_rows(load, capacity, backward), backward),
                                      [b.alltoall(pair, deps)], "experts")
        done = [b.alltoall(pair, [computed])]
    if backward and group > 1:
        done = [b.collective(ALLTOALL, network.reducescatter(stored * group, group), done, "reducescatter")]
    return done


def _whole_experts(cluster: Cluster, model: ModelSpec, plan: StepPlan) -> None:
    world, num_experts = cluster.world_size, model.dims.num_experts
    if num_experts % world:
        raise ValueError(f"the {plan.schedule} schedule needs experts ({num_experts}) divisible by the {world} "
                         "ranks; use more experts, fewer ranks, or the adaptive schedule")


def _expert_plans(name: str, space: PlanSpace) -> list[StepPlan]:
    """Every degree, all-to-all algorithm and number of shadowed experts, where whole experts divide."""
    if not space.experts_divide:
        return []
    return [StepPlan(name, degree, algorithm, prioritize_alltoall=space.prioritize_alltoall, shadowed=shadowed)
            for degree, algorithm, shadowed in itertools.product(space.degrees, space.algorithms, space.shadowed)]


def _smart_plans(name: str, space: PlanSpace) -> list[StepPlan]:
    """Pairwise steps need several nodes to differ from the expert schedule."""
    if not space.experts_divide or space.cluster.nodes == 1:
        return []
    return [StepPlan(name, prioritize_alltoall=space.prioritize_alltoall, shadowed=s) for s in space.shadowed]


def _adaptive_plans(name: str, space: PlanSpace) -> list[StepPlan]:
    """Every valid r, but r = 1 on whole experts, which is the expert schedule at d = 1."""
    world, num_experts = space.cluster.world_size, space.model.dims.num_experts
    return [StepPlan(name, prioritize_alltoall=space.prioritize_alltoall, r=r)
            for r in switchable_rs(num_experts, world) if r != 1 or world > num_experts]


def _switchable_layout(cluster: Cluster, model: ModelSpec, plan: StepPlan) -> None:
    validate_r(plan.r, model.dims.num_experts, cluster.world_size)
    check_switchable_layout(model.dims.num_experts, cluster.world_size, model.dims.hidden_dim)


EXPERT = SimulatedSchedule(expert_region, _expert_plans, _whole_experts,
                           lambda plan: f"{plan.schedule} d={plan.degree} {plan.algorithm}")
REPLICATED = SimulatedSchedule(
    replicated_region, lambda name, space: [StepPlan(name, prioritize_alltoall=space.prioritize_alltoall)],
    settings=lambda plan: {"parallel": plan.schedule})
SMART = SimulatedSchedule(smart_region, _smart_plans, _whole_experts, lambda plan: f"{plan.schedule} pairwise",
                          settings=lambda plan: {"parallel": EXPERT_SCHEDULE, "pipeline": plan.schedule})
ADAPTIVE = SimulatedSchedule(adaptive_region, _adaptive_plans, _switchable_layout,
                             lambda plan: f"{plan.schedule} r={plan.r}",
                             settings=lambda plan: {"parallel": plan.r, "pipeline": plan.degree,
                                                    "alltoall": plan.algorithm})
