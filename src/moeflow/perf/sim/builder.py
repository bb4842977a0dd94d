"""The builder of one simulated step: the costs (GEMMs, copies, collectives on the cluster's
links) and the step's frame (attention, gate and encode, the technique's expert region, decode, the
LM head, the gradient sync, the optimizer), written as operations on a
:class:`~moeflow.perf.sim.engine.Timeline`. Which region runs is the technique's record's: the builder is
handed it (:func:`moeflow.sim.step.step_builder`) and never asks for a schedule by name."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moeflow.config import dedup_row_share, empty_share, wire_row_bytes
from moeflow.perf.balance import slot_tokens
from moeflow.perf.pipeline import capacity_chunks
from moeflow.perf.replicas import balanced_slots
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.cores import shared_core_seconds
from moeflow.perf.sim.engine import ALLTOALL, COMPUTE, GRADIENTS, MODEL_PARALLEL, Timeline, Times
from moeflow.perf.sim.network import LocalCopy, Network, Step
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.workload import LayerLoad, ModelSpec

Region = Callable[["StepBuilder", LayerLoad, list[int], bool], list[int]]
"""A technique's expert region: (builder, the layer's load, what it waits for, backward) -> its last operations."""
ADAM_BYTES_PER_PARAMETER = 16  # fp32 master weight, gradient, two moments: read and written once


class StepBuilder:
    """Writes the operations of one step for one (cluster, model, plan)."""

    def __init__(self, cluster: Cluster, model: ModelSpec, plan: StepPlan, region: Region, gated_share: float = 1.0,
                 replicates_experts: bool = False, training: bool = True, layer_only: bool = False,
                 world: Cluster | None = None) -> None:
        """``cluster`` is one expert group's ranks; ``world`` every rank (the gradient all-reduces
        span it), when the groups are copied over data-parallel replicas."""
        self.cluster, self.model, self.plan, self.training = cluster, model, plan, training
        self.region = region  # the schedule's expert region (its record's)
        self.gated_share = gated_share  # the share of its MP group's tokens a rank gates (Parm's S1: 1 / N_MP)
        self.replicates_experts = replicates_experts  # every expert on every rank: data-parallel weights
        self.layer_only = layer_only  # the MoE layers alone: no attention, gradient all-reduce or optimizer
        self.network = Network(cluster)
        self.world_network = Network(world) if world is not None and world is not cluster else self.network
        self.replicas = self.world_network.world // cluster.world_size  # copies of each expert group
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

    def copy_s(self, nbytes: float) -> float:
        """A stride copy of ``nbytes`` (read and written) at the device's copy rate (2DH's layout copies)."""
        rate = self.device.copy_bandwidth or self.device.memory_bandwidth
        return self.device.kernel_overhead_s + 2 * nbytes / rate

    def ffn_s(self, rows: Times, backward: bool, local_experts: int | None = None, shards: int = 1) -> Times:
        """The experts' GEMMs on ``rows`` tokens, each expert's hidden dimension cut in ``shards``."""
        d = self.model.dims
        local = local_experts or max(1, d.num_experts // self.cluster.world_size)
        flops = 2 * rows * d.model_dim * (d.hidden_dim / shards) * d.projections
        seconds = self.gemm_s(flops, kernels=local * ffn_kernels(d.projections), backward=backward)
        if np.ndim(seconds) and self.device.cores:  # a skewed load on ranks that share cores
            return shared_core_seconds(seconds, self.device.cores, self.device.ranks_per_machine)
        return seconds

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

    @property
    def row_bytes(self) -> int:
        """Bytes one exchanged token row takes on the link, in the plan's wire format."""
        return wire_row_bytes(self.plan.wire_dtype, self.model.dims.model_dim, self.model.element_bytes)

    def pair_bytes(self, slots: int, num_experts: int | None = None) -> float:
        """Bytes one rank sends another for ``slots`` capacity slots of the travelling experts."""
        m = self.model
        travelling = num_experts or m.dims.num_experts
        return float(travelling * slots * self.row_bytes) / self.cluster.world_size

    def chunk_pair_bytes(self, load: LayerLoad, start: int, stop: int) -> float:
        """Bytes one rank sends another for the chunk of slots [start, stop): all of them, or under a
        ragged exchange the kept rows, priced as the busiest sender's rows for other ranks spread
        evenly over its peers (its link is what the all-to-all waits for); under ``auto`` a chunk
        too full to pay for the gather and scatter goes padded, as the layer sends it."""
        world = self.cluster.world_size
        if not self.plan.ragged_exchange or world == 1:
            return self.pair_bytes(stop - start, load.counts.shape[1])
        rows = np.clip(load.counts - start, 0, stop - start)
        if empty_share(float(rows.sum()), rows.size, stop - start) < self.plan.ragged_min_saving:
            return self.pair_bytes(stop - start, load.counts.shape[1])  # too full: 'auto' sends it padded
        elsewhere = self.owner_ranks(load)[None, :] != np.arange(world)[:, None]
        busiest = float((rows * elsewhere).sum(axis=1).max())
        return busiest / (world - 1) * self.row_bytes

    @property
    def exchange_share(self) -> float:
        """The share of a chunk's kept rows each all-to-all sends: below 1 where a token crosses to
        each rank once, both ways (``token_exchange='dedup'``, choices spread uniformly)."""
        return self._dedup_share(self.cluster.world_size)

    @property
    def inter_node_share(self) -> float:
        """Under the dedup exchange's 2DH hops, the rows between nodes (one per (token, node)) as a
        share of the rank-level rows (one per (token, rank))."""
        if self.plan.algorithm != "2dh":
            return 1.0
        return self._dedup_share(self.cluster.nodes) / self.exchange_share

    def _dedup_share(self, places: int) -> float:
        if self.plan.dedup_top_k is None:
            return 1.0
        return dedup_row_share(self.model.dims.num_experts, places, self.plan.dedup_top_k)

    def expert_rows(self, load: LayerLoad, capacity: int, backward: bool = False) -> Times:
        """Rows each rank's experts compute: the padded buffer (f != 0), or the tokens it received
        (dropless f = 0: only real rows run, except in a ``padded_backward`` plan's backward), per rank."""
        m, world = self.model, self.cluster.world_size
        travelling, num_experts = load.counts.shape[1], m.dims.num_experts
        if m.capacity_factor != 0 or world > num_experts or (backward and self.plan.padded_backward):
            return float(travelling * capacity)
        received = np.minimum(load.counts, capacity).sum(axis=0)
        per_rank = np.bincount(self.owner_ranks(load), weights=received, minlength=world)
        return rank_times(per_rank)

    def owner_ranks(self, load: LayerLoad) -> np.ndarray:
        """The rank computing each column of ``load``: its own, or expert parallelism's."""
        if load.owners is not None:
            return load.owners
        return load.experts * self.cluster.world_size // self.model.dims.num_experts

    def local_rows(self, load: LayerLoad, capacity: int) -> Times:
        if self.model.capacity_factor != 0:
            return float(load.counts.shape[1] * capacity)
        return rank_times(np.minimum(load.counts, capacity).sum(axis=1))

    # -- collectives ------------------------------------------------------------------------------

    def collective(self, stream: str, steps: list[Step], deps: list[int], category: str, priority: int = 0) -> int:
        """The steps of one collective in order; returns the last (or an empty marker when none)."""
        last = deps
        for step in steps:
            if isinstance(step, LocalCopy):
                index = self.timeline.compute(stream, self.copy_s(step.bytes_per_rank), last, category)
            else:
                index = self.timeline.transfer(stream, step, last, category, priority)
            last = [index]
        if last is deps:
            return self.timeline.compute(stream, 0.0, deps, category)
        return last[0]

    def alltoall(self, pair_bytes: float, deps: list[int]) -> int:
        key = ("alltoall", self.plan.algorithm, pair_bytes)
        if key not in self._transfers:
            self._transfers[key] = self.network.alltoall(self.plan.algorithm, pair_bytes, self.inter_node_share)
        return self.collective(ALLTOALL, self._transfers[key], deps, "alltoall", self.priority)

    def allreduce(self, nbytes: float, deps: list[int]) -> int:
        key = ("allreduce", self.plan.allreduce, nbytes)
        if key not in self._transfers:
            self._transfers[key] = self.network.allreduce(nbytes, self.plan.allreduce)
        return self.collective(GRADIENTS, self._transfers[key], deps, "allreduce")

    def gradient_allreduce(self, nbytes: float, deps: list[int]) -> int:
        """An all-reduce over every rank (the dense gradients), as this group's links see it."""
        if self.replicas == 1:  # the group is the world
            return self.allreduce(nbytes, deps)
        key = ("gradients", self.plan.allreduce, nbytes)
        if key not in self._transfers:
            steps = self.world_network.allreduce(nbytes, self.plan.allreduce)
            self._transfers[key] = self.world_network.onto(self.network, steps)
        return self.collective(GRADIENTS, self._transfers[key], deps, "allreduce")

    def replica_allreduce(self, nbytes: float, deps: list[int]) -> int:
        """An all-reduce over the copies of this group's experts (ranks equal modulo its size)."""
        key = ("replicas", nbytes)
        if key not in self._transfers:
            steps = self.world_network.strided_allreduce(nbytes, self.cluster.world_size)
            self._transfers[key] = self.world_network.onto(self.network, steps)
        return self.collective(GRADIENTS, self._transfers[key], deps, "allreduce-experts")

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
            synced.append(self.gradient_allreduce(pending, tail))
            pending = 0.0
        for index, load in enumerate(reversed(loads)):
            tail = [self._layer(load, tail, backward=True)]
            pending += self._gradient_bytes()
            if not self.layer_only and (pending >= self.plan.bucket_mb * 1e6 or index == len(loads) - 1):
                synced.append(self.gradient_allreduce(pending, tail))  # a full bucket (or each layer's own)
                pending = 0.0
        if self.layer_only:
            return self.timeline
        if self.replicas > 1 and not self.replicates_experts:  # the trainer sums the copies once, after the backward
            experts = self.model.layers * self._expert_parameters_per_rank() * self.model.element_bytes
            synced.append(self.replica_allreduce(experts, tail))
        m = self.model
        if m.vocab_size:  # the input embedding's gradient, all-reduced once the backward is done
            synced.append(self.gradient_allreduce(self._head_bytes(), tail))
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
        m = self.model
        share = self.gated_share
        buffer = share * self.buffer_bytes(load)
        call = (self.device.layer_call_backward_s if backward else self.device.layer_call_s) + \
            self.device.chunk_s * (len(capacity_chunks(self.capacity(load), self.plan.degree)) - 1)
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
        region = self.region
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
        """EPLB's slots, placed for this layer's load (each replicated expert's tokens split as the
        layer splits them): a rank's tokens for its own slots stay out of the exchange
        (``ReplicaRowMap``), so the schedule's region runs over the rest and the own part is
        computed at home after it (before it in the backward); then in the backward the replicated
        experts' gradient all-reduce, which the layer waits for."""
        world, dims = self.cluster.world_size, self.model.dims
        per_rank = (dims.num_experts + self.plan.redundant_slots) // world
        slots = balanced_slots(load.counts.sum(axis=0).tolist(), per_rank, world, self.cluster.gpus_per_node)
        slot_experts = np.array([expert for experts in slots for expert in experts])
        slot_ranks = np.repeat(np.arange(world), per_rank)
        counts_WP = slot_tokens(load.counts, slot_experts, slot_ranks).astype(np.float64)
        own_WP = slot_ranks[None, :] == np.arange(world)[:, None]
        exchanged = LayerLoad(np.where(own_WP, 0.0, counts_WP), slot_experts, slot_ranks)
        home_s = self.ffn_s(rank_times((counts_WP * own_WP).sum(axis=1)), backward, per_rank)
        if backward:
            home = self.timeline.compute(COMPUTE, home_s, deps, "experts")
            done = self.region(self, exchanged, [home], backward)
        else:
            done = [self.timeline.compute(COMPUTE, home_s, self.region(self, exchanged, deps, backward), "experts")]
        replicated = int((np.bincount(slot_experts) > 1).sum())
        if backward and replicated:
            done = [self.allreduce(float(replicated * dims.expert_parameters * self.model.element_bytes), done)]
        return done

    def _attention_flops(self) -> float:
        m, model_dim = self.model, self.model.dims.model_dim
        return 2 * 4 * m.tokens_per_rank * model_dim**2 + 2 * 2 * m.tokens_per_rank * m.sequence_length * model_dim

    def _expert_parameters_per_rank(self) -> float:
        d = self.model.dims
        local = d.num_experts if self.replicates_experts else d.num_experts / self.cluster.world_size
        return local * d.expert_parameters

    def _gradient_bytes(self) -> float:
        """The layer's gradients all-reduced over the world on the gradients stream (overlapping
        the backward of the layers below): dense ones always, the experts' when replicated."""
        m = self.model
        replicated = m.dims.num_experts * m.dims.expert_parameters if self.replicates_experts else 0
        return float((self._dense_parameters_per_rank() + replicated) * m.element_bytes)

    def _dense_parameters_per_rank(self) -> float:
        """Attention and gate; each MP member holds 1 / mp of the attention."""
        m = self.model
        return m.dense_parameters() - 4 * m.dims.model_dim**2 * (1 - 1 / self.plan.mp)


def ffn_kernels(projections: int) -> int:
    """Kernels of one expert FFN call: a GEMM per projection and the activation between."""
    return projections + 1


def shadowed_experts(load: LayerLoad, count: int) -> np.ndarray:
    """The ``count`` experts with the most tokens (FasterMoE shadows the hottest)."""
    return np.argsort(-load.counts.sum(axis=0), kind="stable")[:count]


def shadowed_rows(load: LayerLoad, hot: np.ndarray) -> Times:
    """Tokens each rank computes at home for the shadowed experts."""
    return rank_times(load.counts[:, hot].sum(axis=1))


def rank_times(per_rank: np.ndarray) -> Times:
    """A per-rank quantity as the engine takes it: one value where every rank's is the same (a
    balanced load runs as one rank's), else the array (a skewed load makes a straggler)."""
    return per_rank if np.ptp(per_rank) > 0 else float(per_rank[0])
