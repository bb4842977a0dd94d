"""One training step (forward, backward, gradient sync, optimizer) or one inference batch of an MoE
transformer, written as a :class:`~moeflow.sim.engine.Timeline` and run.

Per layer: attention, gate and encode on the compute stream; the dispatch all-to-all of each of d
capacity chunks on the all-to-all stream (issued D1..Dd, then C1..Cd, as moeflow's executor does);
each chunk's experts on the compute stream; the combines; decode. The backward mirrors it with the
device's backward FLOP ratio, then all-reduces the layer's dense gradients on the gradients stream,
where it competes with later layers' all-to-alls for the links (Lina's contention), unless
``prioritize_alltoall`` serves the all-to-all first (Lina's fix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeflow.config import ALLTOALL_ALGORITHMS
from moeflow.perf.pipeline import capacity_chunks
from moeflow.sim.cluster import Cluster
from moeflow.sim.engine import Timeline, Times
from moeflow.sim.network import ALLREDUCE_ALGORITHMS, LocalCopy, Network, Step
from moeflow.sim.workload import LayerLoad, ModelSpec, routing_loads

SIM_SCHEDULES = ("expert", "replicated")
COMPUTE, ALLTOALL, GRADIENTS = "compute", "alltoall", "gradients"
ADAM_BYTES_PER_PARAMETER = 16  # fp32 master weight, gradient, two moments: read and written once


@dataclass(frozen=True)
class StepPlan:
    """The knobs of one step: parallel schedule, pipeline degree, all-to-all algorithm, the
    gradient all-reduce's algorithm, and whether all-to-alls take the links first."""

    schedule: str = "expert"
    degree: int = 1
    algorithm: str = "linear"
    allreduce: str = "auto"
    prioritize_alltoall: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SIM_SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SIM_SCHEDULES)}, got {self.schedule!r}")
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"pipeline degree must be an integer >= 1, got {self.degree!r}")
        if self.algorithm not in ALLTOALL_ALGORITHMS:
            raise ValueError(
                f"all-to-all algorithm must be one of {', '.join(ALLTOALL_ALGORITHMS)}, got {self.algorithm!r}")
        if self.allreduce not in (*ALLREDUCE_ALGORITHMS, "auto"):
            raise ValueError(f"all-reduce must be auto, ring or tree, got {self.allreduce!r}")

    def label(self) -> str:
        base = f"{self.schedule} d={self.degree} {self.algorithm}" if self.schedule == "expert" else self.schedule
        return base + (" prioritized" if self.prioritize_alltoall else "")


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
        return {"plan": self.plan.label(), "step_ms": self.step_s * 1e3,
                "busy_ms": {k: v * 1e3 for k, v in sorted(self.busy_s.items())},
                "dropped": self.dropped, "operations": self.operations, **self.extra}


class StepBuilder:
    """Writes the operations of one step for one (cluster, model, plan)."""

    def __init__(self, cluster: Cluster, model: ModelSpec, plan: StepPlan, training: bool = True) -> None:
        world = cluster.world_size
        if plan.schedule == "expert" and model.experts % world:
            raise ValueError(
                f"the expert schedule needs experts ({model.experts}) divisible by the {world} ranks; "
                "use more experts or fewer ranks"
            )
        self.cluster, self.model, self.plan, self.training = cluster, model, plan, training
        self.network = Network(cluster)
        self.timeline = Timeline(world)
        self.device = cluster.device
        self._transfers: dict[tuple, list[Step]] = {}

    # -- costs ------------------------------------------------------------------------------------

    def gemm_s(self, flops: Times, kernels: int = 1, backward: bool = False) -> Times:
        ratio = self.device.backward_ratio if backward else 1.0
        return kernels * self.device.kernel_overhead_s * ratio + ratio * flops / self.device.gemm_flops

    def memory_s(self, nbytes: float, kernels: int = 1) -> float:
        return kernels * self.device.kernel_overhead_s + nbytes / self.device.memory_bandwidth

    def _cached(self, key: tuple, make: Any) -> list[Step]:
        if key not in self._transfers:
            self._transfers[key] = make()
        return self._transfers[key]

    def collective(self, stream: str, steps: list[Step], deps: list[int], category: str, priority: int = 0) -> int:
        """The steps of one collective in order; returns the last (or the dependency when none)."""
        last = deps
        for step in steps:
            if isinstance(step, LocalCopy):
                index = self.timeline.compute(stream, self.memory_s(2 * step.bytes_per_rank), last, category)
            else:
                index = self.timeline.transfer(stream, step, last, category, priority)
            last = [index]
        if last is deps:  # nothing sent (one rank): an empty marker keeps the order
            return self.timeline.compute(stream, 0.0, deps, category)
        return last[0]

    # -- the step ---------------------------------------------------------------------------------

    def build(self, loads: list[LayerLoad]) -> Timeline:
        model = self.model
        tail: list[int] = []
        layer_ends = []
        for load in loads:
            tail = [self._forward_layer(load, tail)]
            layer_ends.append(tail[0])
        if not self.training:
            return self.timeline
        synced = []
        for load in reversed(loads):
            tail = [self._backward_layer(load, tail)]
            synced.append(self._gradient_sync(load, tail))
        params = model.layers * (model.dense_parameters() + self._expert_parameters_per_rank())
        self.timeline.compute(COMPUTE, self.memory_s(params * ADAM_BYTES_PER_PARAMETER), tail + synced, "optimizer")
        return self.timeline

    def _attention_flops(self) -> float:
        m = self.model
        return 2 * 4 * m.tokens_per_rank * m.model_dim**2 + 2 * 2 * m.tokens_per_rank * m.sequence_length * m.model_dim

    def _expert_parameters_per_rank(self) -> int:
        m = self.model
        local = m.experts if self.plan.schedule == "replicated" else m.experts // self.cluster.world_size
        return local * m.expert_parameters()

    def _forward_layer(self, load: LayerLoad, deps: list[int]) -> int:
        m = self.model
        attention = self.timeline.compute(COMPUTE, self.gemm_s(self._attention_flops(), kernels=6), deps, "attention")
        capacity = load.capacity(m)
        routed = self.timeline.compute(
            COMPUTE, self.gemm_s(2 * m.tokens_per_rank * m.model_dim * m.experts)
            + self.memory_s(self._buffer_bytes(capacity) + m.tokens_per_rank * m.model_dim * m.element_bytes, 2),
            [attention], "gate+encode")
        experts = self._experts(load, capacity, [routed], backward=False)
        return self.timeline.compute(COMPUTE, self.memory_s(self._buffer_bytes(capacity), 1), experts, "decode")

    def _backward_layer(self, load: LayerLoad, deps: list[int]) -> int:
        m = self.model
        capacity = load.capacity(m)
        decoded = self.timeline.compute(COMPUTE, self.memory_s(self._buffer_bytes(capacity), 1), deps, "decode")
        experts = self._experts(load, capacity, [decoded], backward=True)
        routed = self.timeline.compute(
            COMPUTE, self.gemm_s(2 * m.tokens_per_rank * m.model_dim * m.experts, backward=True)
            + self.memory_s(self._buffer_bytes(capacity), 2), experts, "gate+encode")
        return self.timeline.compute(
            COMPUTE, self.gemm_s(self._attention_flops(), kernels=6, backward=True), [routed], "attention")

    def _buffer_bytes(self, capacity: int) -> float:
        m = self.model
        return m.experts * capacity * m.model_dim * m.element_bytes

    def _experts(self, load: LayerLoad, capacity: int, deps: list[int], backward: bool) -> list[int]:
        """The expert region: d chunks of dispatch, experts, combine (or local experts only)."""
        if self.plan.schedule == "replicated" or self.cluster.world_size == 1:
            rows = self._local_rows(load, capacity)
            return [self.timeline.compute(COMPUTE, self._ffn_s(rows, backward), deps, "experts")]
        chunks = [stop - start for start, stop in capacity_chunks(capacity, self.plan.degree)] or [0]
        priority = 1 if self.plan.prioritize_alltoall else 0
        dispatched = [self._alltoall(chunk, deps, priority) for chunk in chunks]
        rows = self._expert_rows(load, capacity)
        computed = [self.timeline.compute(COMPUTE, self._ffn_s(rows * (chunk / max(capacity, 1)), backward), [d],
                                          "experts") for chunk, d in zip(chunks, dispatched, strict=True)]
        return [self._alltoall(chunk, [c], priority) for chunk, c in zip(chunks, computed, strict=True)]

    def _alltoall(self, chunk: int, deps: list[int], priority: int) -> int:
        m = self.model
        local = m.experts // self.cluster.world_size
        pair_bytes = float(local * chunk * m.model_dim * m.element_bytes)
        key = ("alltoall", self.plan.algorithm, pair_bytes)
        steps = self._cached(key, lambda: self.network.alltoall(self.plan.algorithm, pair_bytes))
        return self.collective(ALLTOALL, steps, deps, "alltoall", priority)

    def _expert_rows(self, load: LayerLoad, capacity: int) -> Times:
        """Rows each rank's experts compute: the padded buffer (f != 0), or the tokens it received
        (dropless f = 0: only real rows run), per rank."""
        m, world = self.model, self.cluster.world_size
        local = m.experts // world
        if m.capacity_factor != 0:
            return float(world * capacity * local)
        received = load.counts.sum(axis=0).reshape(world, local).sum(axis=1)
        return received if np.ptp(received) > 0 else float(received[0])

    def _local_rows(self, load: LayerLoad, capacity: int) -> Times:
        m = self.model
        if m.capacity_factor != 0:
            return float(m.experts * capacity)
        own = np.minimum(load.counts, capacity).sum(axis=1)
        return own if np.ptp(own) > 0 else float(own[0])

    def _ffn_s(self, rows: Times, backward: bool) -> Times:
        m = self.model
        local = m.experts if self.plan.schedule == "replicated" else max(1, m.experts // self.cluster.world_size)
        flops = 2 * rows * m.model_dim * m.hidden_dim * m.projections
        return self.gemm_s(flops, kernels=local * (m.projections + 1), backward=backward)

    def _gradient_sync(self, load: LayerLoad, deps: list[int]) -> int:
        """The layer's gradients all-reduced over the world on the gradients stream (overlapping
        the backward of the layers below): dense ones always, the experts' in the replicated
        schedule."""
        m = self.model
        params = m.dense_parameters() + (m.experts * m.expert_parameters() if self.plan.schedule == "replicated" else 0)
        nbytes = float(params * m.element_bytes)
        steps = self._cached(("allreduce", self.plan.allreduce, nbytes),
                             lambda: self.network.allreduce(nbytes, self.plan.allreduce))
        return self.collective(GRADIENTS, steps, deps, "allreduce")


def simulate_step(cluster: Cluster, model: ModelSpec, plan: StepPlan | None = None, training: bool = True,
                  loads: list[LayerLoad] | None = None) -> StepResult:
    """Simulate one training step (``training``) or one inference batch; the slowest rank's time."""
    plan = plan or StepPlan()
    loads = routing_loads(model, cluster.world_size) if loads is None else loads
    builder = StepBuilder(cluster, model, plan, training)
    timeline = builder.build(loads).run()
    dropped = sum(load.dropped(model) for load in loads)
    return StepResult(plan, timeline.makespan(), timeline.busy(), dropped, len(timeline.ops))
