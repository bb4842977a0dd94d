"""One training step (forward, backward, gradient sync, optimizer) or one inference batch of an MoE
transformer, written as a :class:`~moeflow.sim.engine.Timeline` and run.

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

import numpy as np

from moeflow.comm.topology import Topology
from moeflow.config import ALLTOALL_ALGORITHMS, check_switchable_layout, validate_r
from moeflow.parallel.redundant import balanced_placement, replicated_experts
from moeflow.parallel.registry import MODEL_PARALLEL_SCHEDULES, SIMULATED_REGIONS
from moeflow.perf.balance import slot_tokens
from moeflow.sim.cluster import Cluster
from moeflow.sim.engine import ALLTOALL, COMPUTE, GRADIENTS, MODEL_PARALLEL, Timeline, Times
from moeflow.sim.network import ALLREDUCE_ALGORITHMS, LocalCopy, Network, Step
from moeflow.sim.parm_regions import gated_share
from moeflow.sim.regions import shadowed_experts, shadowed_rows
from moeflow.sim.workload import LayerLoad, ModelSpec, routing_loads

ADAM_BYTES_PER_PARAMETER = 16  # fp32 master weight, gradient, two moments: read and written once


@dataclass(frozen=True)
class StepPlan:
    """The knobs of one step: parallel schedule (with Tutel's ``r`` for ``adaptive``), pipeline
    degree and all-to-all algorithm (``expert``), the hottest experts FasterMoE shadows per layer,
    the gradient all-reduce's algorithm, whether all-to-alls take the links first (Lina), and for
    Parm's schedules the tensor-parallel (``mp``) and expert-sharding (``esp``) group sizes."""

    schedule: str = "expert"
    degree: int = 1
    algorithm: str = "linear"
    allreduce: str = "auto"
    prioritize_alltoall: bool = False
    r: int | None = None
    shadowed: int = 0
    bucket_mb: float = 0.0  # gradients all-reduced in buckets of this many MB (DDP: 25); 0: per layer
    mp: int = 1  # N_MP: attention split over this many consecutive ranks (Megatron), Parm's schedules only
    esp: int = 1  # N_ESP: each expert's hidden dimension sharded over this many consecutive ranks
    padded_backward: bool = False  # dropless backward on the padded buffer (moeflow's CPU ragged kernel until 11-26)
    shadowed_slots_travel: bool = False  # shadowed experts' slots stay in the exchange, cut (moeflow's shadowing)
    packed_s1: bool = False  # S1 sends only its occupied slots (moeflow's S1; Parm's sends 1 / N_MP of the capacity)
    ragged_exchange: bool = False  # the expert exchange sends only kept rows (moeflow's token_exchange='ragged')
    redundant_slots: int = 0  # EPLB: this many extra expert slots, placed for each layer's load

    def __post_init__(self) -> None:
        if self.schedule not in SIMULATED_REGIONS:
            raise ValueError(f"schedule must be one of {', '.join(SIMULATED_REGIONS)}, got {self.schedule!r}")
        for name in ("degree", "shadowed", "mp", "esp", "redundant_slots"):
            value, least = getattr(self, name), 0 if name in ("shadowed", "redundant_slots") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if (self.mp > 1 or self.esp > 1) and self.schedule not in MODEL_PARALLEL_SCHEDULES:
            raise ValueError(f"mp and esp > 1 go with Parm's schedules ({', '.join(MODEL_PARALLEL_SCHEDULES)}), "
                             f"not {self.schedule!r}")
        if self.algorithm not in ALLTOALL_ALGORITHMS:
            raise ValueError(
                f"all-to-all algorithm must be one of {', '.join(ALLTOALL_ALGORITHMS)}, got {self.algorithm!r}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, int | float) or self.bucket_mb < 0:
            raise ValueError(f"bucket_mb must be a number >= 0 (0: one all-reduce per layer), got {self.bucket_mb!r}")
        if self.allreduce not in (*ALLREDUCE_ALGORITHMS, "auto"):
            raise ValueError(f"all-reduce must be auto, ring or tree, got {self.allreduce!r}")
        if (self.schedule == "adaptive") != (self.r is not None):
            raise ValueError("Tutel's r goes with the adaptive schedule, and the adaptive schedule needs an r")

    def label(self) -> str:
        base = {"expert": f"expert d={self.degree} {self.algorithm}", "adaptive": f"adaptive r={self.r}",
                "smart": "smart pairwise"}.get(self.schedule, self.schedule)
        if self.schedule in MODEL_PARALLEL_SCHEDULES:
            base += (f" d={self.degree}" if self.degree > 1 else "") + f" mp={self.mp} esp={self.esp}"
        return base + (" ragged" if self.ragged_exchange else "") + \
            (f" shadow={self.shadowed}" if self.shadowed else "") + \
            (f" slots+{self.redundant_slots}" if self.redundant_slots else "") + \
            (" prioritized" if self.prioritize_alltoall else "")


def simulated_algorithm(name: str | None) -> str:
    """The all-to-all algorithm the simulator prices for a layer's: its own, or linear for the
    names it has no model of ("none": nothing sent; Parm's fused combines)."""
    return name if name in ALLTOALL_ALGORITHMS else "linear"


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
        return {"plan": self.plan.label(), "step_ms": round(self.step_s * 1e3, 4),
                "busy_ms": {k: round(v * 1e3, 4) for k, v in sorted(self.busy_s.items())},
                "dropped": self.dropped, "operations": self.operations, **self.extra}


class StepBuilder:
    """Writes the operations of one step for one (cluster, model, plan)."""

    def __init__(self, cluster: Cluster, model: ModelSpec, plan: StepPlan, training: bool = True,
                 layer_only: bool = False) -> None:
        _check_layout(cluster, model, plan)
        self.cluster, self.model, self.plan, self.training = cluster, model, plan, training
        self.layer_only = layer_only  # the MoE layers alone: no attention, gradient all-reduce or optimizer
        self.network = Network(cluster)
        self.timeline = Timeline(cluster.world_size)
        self.device = cluster.device
        self.priority = 1 if plan.prioritize_alltoall else 0
        self._transfers: dict[tuple, list[Step]] = {}
        self.forward_ops = 0

    # -- costs ------------------------------------------------------------------------------------

    def gemm_s(self, flops: Times, kernels: int = 1, backward: bool = False) -> Times:
        ratio = self.device.backward_ratio if backward else 1.0
        return kernels * self.device.kernel_overhead_s * ratio + ratio * flops / self.device.gemm_flops

    def memory_s(self, nbytes: float, kernels: int = 1) -> float:
        return kernels * self.device.kernel_overhead_s + nbytes / self.device.memory_bandwidth

    def ffn_s(self, rows: Times, backward: bool, local_experts: int | None = None, shards: int = 1) -> Times:
        """The experts' GEMMs on ``rows`` tokens, each expert's hidden dimension cut in ``shards``."""
        d = self.model.dims
        local = local_experts or max(1, d.num_experts // self.cluster.world_size)
        flops = 2 * rows * d.model_dim * (d.hidden_dim / shards) * d.projections
        return self.gemm_s(flops, kernels=local * ffn_kernels(d.projections), backward=backward)

    def capacity(self, load: LayerLoad) -> int:
        return load.capacity(self.model)

    @property
    def token_bytes(self) -> float:
        """One rank's tokens entering an MoE layer (T x M)."""
        m = self.model
        return float(m.tokens_per_rank * m.dims.model_dim * m.element_bytes)

    def buffer_bytes(self, load: LayerLoad) -> float:
        """One rank's dispatched buffer (E x C x M)."""
        m = self.model
        return float(m.dims.num_experts * self.capacity(load) * m.dims.model_dim * m.element_bytes)

    def pair_bytes(self, slots: int, num_experts: int | None = None) -> float:
        """Bytes one rank sends another for ``slots`` capacity slots of the travelling experts."""
        m = self.model
        travelling = num_experts or m.dims.num_experts
        return float(travelling * slots * m.dims.model_dim * m.element_bytes) / self.cluster.world_size

    def chunk_pair_bytes(self, load: LayerLoad, start: int, stop: int) -> float:
        """Bytes one rank sends another for the chunk of slots [start, stop): all of them, or under a
        ragged exchange the kept rows, priced as the busiest sender's rows for other ranks spread
        evenly over its peers (its link is what the all-to-all waits for)."""
        world = self.cluster.world_size
        if not self.plan.ragged_exchange or world == 1:
            return self.pair_bytes(stop - start, load.counts.shape[1])
        rows = np.clip(load.counts - start, 0, stop - start)
        elsewhere = self.owner_ranks(load)[None, :] != np.arange(world)[:, None]
        busiest = float((rows * elsewhere).sum(axis=1).max())
        m = self.model
        return busiest / (world - 1) * m.dims.model_dim * m.element_bytes

    def expert_rows(self, load: LayerLoad, capacity: int, backward: bool = False) -> Times:
        """Rows each rank's experts compute: the padded buffer (f != 0), or the tokens it received
        (dropless f = 0: only real rows run, except in a ``padded_backward`` plan's backward), per rank."""
        m, world = self.model, self.cluster.world_size
        travelling, num_experts = load.counts.shape[1], m.dims.num_experts
        if m.capacity_factor != 0 or world > num_experts or (backward and self.plan.padded_backward):
            return float(travelling * capacity)
        received = np.minimum(load.counts, capacity).sum(axis=0)
        per_rank = np.bincount(self.owner_ranks(load), weights=received, minlength=world)
        return per_rank if np.ptp(per_rank) > 0 else float(per_rank[0])

    def owner_ranks(self, load: LayerLoad) -> np.ndarray:
        """The rank computing each column of ``load``: its own, or expert parallelism's."""
        if load.owners is not None:
            return load.owners
        return load.experts * self.cluster.world_size // self.model.dims.num_experts

    def local_rows(self, load: LayerLoad, capacity: int) -> Times:
        if self.model.capacity_factor != 0:
            return float(load.counts.shape[1] * capacity)
        own = np.minimum(load.counts, capacity).sum(axis=1)
        return own if np.ptp(own) > 0 else float(own[0])

    # -- collectives ------------------------------------------------------------------------------

    def collective(self, stream: str, steps: list[Step], deps: list[int], category: str, priority: int = 0) -> int:
        """The steps of one collective in order; returns the last (or an empty marker when none)."""
        last = deps
        for step in steps:
            if isinstance(step, LocalCopy):
                index = self.timeline.compute(stream, self.memory_s(2 * step.bytes_per_rank), last, category)
            else:
                index = self.timeline.transfer(stream, step, last, category, priority)
            last = [index]
        if last is deps:
            return self.timeline.compute(stream, 0.0, deps, category)
        return last[0]

    def alltoall(self, pair_bytes: float, deps: list[int]) -> int:
        key = ("alltoall", self.plan.algorithm, pair_bytes)
        if key not in self._transfers:
            self._transfers[key] = self.network.alltoall(self.plan.algorithm, pair_bytes)
        return self.collective(ALLTOALL, self._transfers[key], deps, "alltoall", self.priority)

    def allreduce(self, nbytes: float, deps: list[int]) -> int:
        key = ("allreduce", self.plan.allreduce, nbytes)
        if key not in self._transfers:
            self._transfers[key] = self.network.allreduce(nbytes, self.plan.allreduce)
        return self.collective(GRADIENTS, self._transfers[key], deps, "allreduce")

    # -- the step ---------------------------------------------------------------------------------

    def build(self, loads: list[LayerLoad]) -> Timeline:
        tail: list[int] = []
        for load in loads:
            tail = [self._layer(load, tail, backward=False)]
        tail = self._head(tail, backward=False)
        self.forward_ops = len(self.timeline.ops)  # operations from here on are the backward's
        if not self.training:
            return self.timeline
        tail = self._head(tail, backward=True)
        synced, pending = [], self._head_bytes()  # the LM head's gradient is ready first (untied)
        if pending and not self.layer_only and pending >= self.plan.bucket_mb * 1e6:
            synced.append(self.allreduce(pending, tail))
            pending = 0.0
        for index, load in enumerate(reversed(loads)):
            tail = [self._layer(load, tail, backward=True)]
            pending += self._gradient_bytes()
            if not self.layer_only and (pending >= self.plan.bucket_mb * 1e6 or index == len(loads) - 1):
                synced.append(self.allreduce(pending, tail))  # a full bucket (or each layer's own)
                pending = 0.0
        if self.layer_only:
            return self.timeline
        m = self.model
        if m.vocab_size:  # the input embedding's gradient, all-reduced once the backward is done
            synced.append(self.allreduce(self._head_bytes(), tail))
        params = m.layers * (self._dense_parameters_per_rank() + self._expert_parameters_per_rank()) + \
            2 * m.vocab_size * m.dims.model_dim
        self.timeline.compute(COMPUTE, self.memory_s(params * ADAM_BYTES_PER_PARAMETER), tail + synced, "optimizer")
        return self.timeline

    def _head_bytes(self) -> float:
        """Gradient bytes of the LM head, and of the (untied) input embedding: one vocab x M matrix."""
        m = self.model
        return float(m.vocab_size * m.dims.model_dim * m.element_bytes)

    def _head(self, deps: list[int], backward: bool) -> list[int]:
        """The LM head's GEMM and softmax over the vocabulary (none without a vocabulary)."""
        m = self.model
        if self.layer_only or not m.vocab_size:
            return deps
        seconds = self.gemm_s(2 * m.tokens_per_rank * m.dims.model_dim * m.vocab_size, backward=backward) + \
            self.memory_s(2 * m.tokens_per_rank * m.vocab_size * m.element_bytes)
        return [self.timeline.compute(COMPUTE, seconds, deps, "head")]

    def _layer(self, load: LayerLoad, deps: list[int], backward: bool) -> int:
        """Attention and gate (forward order; the backward runs them after the experts); the gate's
        operation also carries the layer call's fixed host cost."""
        m, plan = self.model, self.plan
        share = gated_share(plan.schedule, plan.mp, plan.esp)  # Parm: tokens this rank gates
        buffer = share * self.buffer_bytes(load)
        call = self.device.layer_call_backward_s if backward else self.device.layer_call_s
        gate = self.gemm_s(2 * share * m.tokens_per_rank * m.dims.model_dim * m.dims.num_experts, backward=backward) + \
            self.memory_s(buffer + share * self.token_bytes, 2) + call
        if not backward:
            routed = self.timeline.compute(COMPUTE, gate, [self._attention(deps, backward)], "gate+encode")
            experts = self._expert_layer(load, [routed], backward)
            return self.timeline.compute(COMPUTE, self.memory_s(buffer), experts, "decode")
        decoded = self.timeline.compute(COMPUTE, self.memory_s(buffer), deps, "decode")
        routed = self.timeline.compute(COMPUTE, gate, self._expert_layer(load, [decoded], backward), "gate+encode")
        return self._attention([routed], backward)

    def _attention(self, deps: list[int], backward: bool) -> int:
        """Attention's GEMMs, split over the MP group, then Megatron's all-reduce of its output (the
        forward's g) or of its input gradient (the backward's f) over that group."""
        mp = self.plan.mp
        seconds = 0.0 if self.layer_only else self.gemm_s(self._attention_flops() / mp, kernels=6, backward=backward)
        attended = self.timeline.compute(COMPUTE, seconds, deps, "attention")
        if self.layer_only or mp == 1:
            return attended
        steps = self.network.allreduce(self.token_bytes, group=mp)
        return self.collective(MODEL_PARALLEL, steps, [attended], "allreduce-mp")

    def _expert_layer(self, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
        """The schedule's region; with shadowing, the hottest experts run at home first (their
        weights broadcast in the forward, their gradients all-reduced in the backward)."""
        region = SIMULATED_REGIONS["replicated" if self.cluster.world_size == 1 else self.plan.schedule]
        if self.plan.redundant_slots and self.cluster.world_size > 1:
            return self._slot_layer(load, deps, backward)
        if not self.plan.shadowed or self.cluster.world_size == 1:
            return region(self, load, deps, backward)
        hot = shadowed_experts(load, self.plan.shadowed)
        nbytes = len(hot) * self.model.dims.expert_parameters * self.model.element_bytes
        shadow = self.network.broadcast(nbytes) if not backward else []
        sent = [self.collective(ALLTOALL, shadow, deps, "broadcast", self.priority)]
        home = self.timeline.compute(COMPUTE, self.ffn_s(shadowed_rows(load, hot), backward, len(hot)), sent,
                                     "experts")
        rest = load.with_shadowed_slots(hot) if self.plan.shadowed_slots_travel else load.without(hot)
        done = region(self, rest, [home], backward)
        if backward:
            done = [self.allreduce(float(nbytes), done)]
        return done

    def _slot_layer(self, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
        """EPLB's slots, placed for this layer's load: the schedule's region over the slots (each
        replicated expert's tokens split as the layer splits them, a rank's tokens for its own
        slots staying home), then in the backward the replicated experts' gradient all-reduce,
        which the layer waits for."""
        world, dims = self.cluster.world_size, self.model.dims
        per_rank = (dims.num_experts + self.plan.redundant_slots) // world
        topology = Topology(world, self.cluster.gpus_per_node)
        placement = balanced_placement(load.counts.sum(axis=0).tolist(), per_rank, topology, dims.hidden_dim)
        slot_experts, slot_ranks = (np.array(column) for column in placement.slots())
        counts_WP = slot_tokens(load.counts, slot_experts, slot_ranks).astype(np.float64)
        done = SIMULATED_REGIONS[self.plan.schedule](self, LayerLoad(counts_WP, slot_experts, slot_ranks), deps,
                                                    backward)
        replicated = len(replicated_experts(placement))
        if backward and replicated:
            done = [self.allreduce(float(replicated * dims.expert_parameters * self.model.element_bytes), done)]
        return done

    def _attention_flops(self) -> float:
        m, model_dim = self.model, self.model.dims.model_dim
        return 2 * 4 * m.tokens_per_rank * model_dim**2 + 2 * 2 * m.tokens_per_rank * m.sequence_length * model_dim

    def _expert_parameters_per_rank(self) -> float:
        d = self.model.dims
        local = d.num_experts if self.plan.schedule == "replicated" else d.num_experts / self.cluster.world_size
        return local * d.expert_parameters

    def _gradient_bytes(self) -> float:
        """The layer's gradients all-reduced over the world on the gradients stream (overlapping
        the backward of the layers below): dense ones always, the experts' when replicated."""
        m = self.model
        replicated = m.dims.num_experts * m.dims.expert_parameters if self.plan.schedule == "replicated" else 0
        return float((self._dense_parameters_per_rank() + replicated) * m.element_bytes)

    def _dense_parameters_per_rank(self) -> float:
        """Attention and gate; each MP member holds 1 / mp of the attention."""
        m = self.model
        return m.dense_parameters() - 4 * m.dims.model_dim**2 * (1 - 1 / self.plan.mp)


def ffn_kernels(projections: int) -> int:
    """Kernels of one expert FFN call: a GEMM per projection and the activation between."""
    return projections + 1


def _check_layout(cluster: Cluster, model: ModelSpec, plan: StepPlan) -> None:
    world, num_experts = cluster.world_size, model.dims.num_experts
    if plan.schedule in ("expert", "smart") and num_experts % world:
        raise ValueError(f"the {plan.schedule} schedule needs experts ({num_experts}) divisible by the {world} "
                         "ranks; use more experts, fewer ranks, or the adaptive schedule")
    if plan.schedule == "adaptive":
        validate_r(plan.r, num_experts, world)
        check_switchable_layout(num_experts, world, model.dims.hidden_dim)
    if plan.schedule in MODEL_PARALLEL_SCHEDULES:
        _check_parm_layout(cluster, model, plan)
    if plan.redundant_slots and (plan.schedule != "expert" or plan.shadowed):
        raise ValueError("redundant_slots (EPLB) run on the expert schedule without shadowing")
    if plan.redundant_slots and (num_experts + plan.redundant_slots) % world:
        raise ValueError(f"the {num_experts} experts + {plan.redundant_slots} redundant slots must split evenly over "
                         f"the {world} ranks")
    if plan.shadowed >= num_experts:
        raise ValueError(f"shadowed ({plan.shadowed}) must be fewer than the {num_experts} experts")


def _check_parm_layout(cluster: Cluster, model: ModelSpec, plan: StepPlan) -> None:
    """MP and ESP groups are consecutive ranks inside one node, and the EP groups share the experts."""
    for name in ("mp", "esp"):
        size = getattr(plan, name)
        if cluster.gpus_per_node % size:
            raise ValueError(f"{name} ({size}) must divide the {cluster.gpus_per_node} GPUs per node: "
                             f"its groups are consecutive ranks inside a node")
    peers = cluster.world_size // plan.esp
    if model.dims.num_experts % peers:
        raise ValueError(f"{model.dims.num_experts} experts do not divide over the {peers} EP ranks (world / esp); "
                         "use a multiple of that many experts or another esp")


def simulate_step(cluster: Cluster, model: ModelSpec, plan: StepPlan | None = None, training: bool = True,
                  loads: list[LayerLoad] | None = None, layer_only: bool = False) -> StepResult:
    """Simulate one training step (``training``) or one inference batch; the slowest rank's time.
    ``layer_only``: the MoE layers alone (what a layer benchmark measures)."""
    plan = plan or StepPlan()
    loads = routing_loads(model, cluster.world_size) if loads is None else loads
    builder = StepBuilder(cluster, model, plan, training, layer_only)
    timeline = builder.build(loads).run()
    dropped = sum(load.dropped(model) for load in loads)
    return StepResult(plan, timeline.makespan(), timeline.busy(), dropped, len(timeline.ops))


def simulated_ms(cluster: Cluster, model: ModelSpec, plan: StepPlan, layer_only: bool = True) -> float:
    """Milliseconds of one simulated training step (by default the MoE layers alone)."""
    return simulate_step(cluster, model, plan, layer_only=layer_only).step_s * 1e3
