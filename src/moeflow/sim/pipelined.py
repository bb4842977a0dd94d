"""A pipelined training step (``plan.pp`` > 1), priced from one stage's simulated micro-batch.

The ranks form ``pp`` stages of world / pp consecutive ranks (``pp`` outermost, as ``moeflow train
--pp-size``), and the global batch stays the model's (its ``tokens_per_rank`` times the world), so
each of the world / pp data ranks reads ``pp`` times the tokens (:func:`data_rank_tokens`). Every
stage runs alike, so one stage's ranks are simulated as a cluster of their own,
on its blocks (the model's layers over the schedule's stages, the largest stage where they do not
divide) and one micro-batch's tokens. That timeline gives the schedule's costs: F (the forward), B
(the backward up to the gradient sync), W (zero-bubble's weight-gradient share of B), the pair of
DualPipeV's overlap, and a send of one micro-batch's activation between stages.
:func:`~moeflow.perf.stage_schedule.simulate_stages` runs the schedule's orders on them; the
gradient sync and the optimizer follow once, after the pipeline drains (``grad_sync = "after"``,
the only sync the pipelined trainer runs).

The model's limits: every stage is priced as the last (it holds the LM head, so it is the slowest
where the model has a vocabulary); the sends do not compete with the stages' own collectives for
the links; the pair's overlap is DualPipe's ideal (each one's exposed all-to-all hidden behind the
other's compute, at no cost to it), and zero-bubble's split backward costs nothing beyond B.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.engine import ALLTOALL, COMPUTE, GRADIENTS, Timeline
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.workload import LayerLoad, ModelSpec
from moeflow.perf.stage_schedule import StageTimes, simulate_stages, stage_orders

StageRun = Callable[[Cluster, ModelSpec, StepPlan, "list[LayerLoad] | None"], tuple[Timeline, int]]
"""Runs one unpipelined step's builder: (ranks, model, plan, loads or None) -> its timeline and the
number of its forward operations (:func:`moeflow.sim.step.stage_timeline`, passed in: this module
sits below the step)."""
GEMM_CATEGORIES = ("attention", "experts", "head")
"""The timeline's categories that are GEMMs: zero-bubble splits their backward in two."""


@dataclass(frozen=True)
class PipelineLayout:
    """Where a pipelined plan runs: one stage's ranks as a cluster, the stage's model (its blocks on
    one micro-batch's tokens), a rank's model (the blocks of every stage it holds, for its gradient
    sync and optimizer), the stage count and the micro-batches."""

    stage_cluster: Cluster
    stage_model: ModelSpec
    rank_model: ModelSpec
    stages: int
    microbatches: int


@dataclass(frozen=True)
class StagePrices:
    """What one stage's actions take, in seconds (what :func:`simulate_stages` reads)."""

    forward_s: float
    backward_s: float
    weight_s: float
    paired_s: float | None
    send_s: float


@dataclass(frozen=True)
class PipelinedStep:
    """A priced pipelined step: its seconds, a rank's busy seconds per category, the pieces."""

    step_s: float
    busy_s: dict[str, float]
    dropped: float
    operations: int
    prices: StagePrices
    tail_s: float
    times: StageTimes

    def extra(self, layout: PipelineLayout) -> dict[str, Any]:
        """The pieces as a report shows them (``StepResult.extra``)."""
        p = self.prices
        return {"pipeline": {
            "stages": layout.stages, "microbatches": layout.microbatches, "forward_ms": p.forward_s * 1e3,
            "backward_ms": p.backward_s * 1e3, "weight_ms": p.weight_s * 1e3, "send_ms": p.send_s * 1e3,
            **({"paired_ms": p.paired_s * 1e3} if p.paired_s is not None else {}),
            "tail_ms": self.tail_s * 1e3, "bubble": self.times.bubble}}


def data_rank_tokens(model: ModelSpec, pp: int) -> int:
    """A data rank's tokens a step under ``pp`` stages, for the same global batch: the model's
    ``tokens_per_rank`` is the global batch over the world, and only world / pp ranks read data
    (every rank of a stage), so each reads ``pp`` times as many. A plan compares layouts on the
    batch the optimizer steps on, and a pipelined plan file says ``batch_size`` times ``pp``."""
    return model.tokens_per_rank * pp


def data_rank_sequences(model: ModelSpec, pp: int) -> int:
    """A data rank's whole sequences a step under ``pp`` stages (:func:`data_rank_tokens`; 0 where
    a rank's tokens are not whole sequences): what the micro-batches divide, and a pipelined plan's
    ``batch_size``."""
    whole = model.tokens_per_rank % model.sequence_length == 0
    return model.tokens_per_rank // model.sequence_length * pp if whole else 0


def pipeline_sizes(cluster: Cluster) -> list[int]:
    """The pipeline sizes whose stages tile the nodes (each divides a node or spans whole ones), 1 first."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    return [pp for pp in range(1, world + 1) if world % pp == 0 and
            (per_node % (world // pp) == 0 or (world // pp) % per_node == 0)]


def blocks_per_rank(layers: int, plan: StepPlan) -> int:
    """The blocks one rank holds under ``plan``: its stages' (each stage the largest, as priced)."""
    if plan.pp == 1:
        return layers
    stages = plan.pipeline_stages
    return math.ceil(layers / stages) * (stages // plan.pp)


def pipeline_layout(cluster: Cluster, model: ModelSpec, plan: StepPlan) -> PipelineLayout:
    """The stage's ranks and model for ``plan``; a ValueError naming the fix where it does not fit."""
    pp, stages, microbatches = plan.pp, plan.pipeline_stages, plan.pipeline_microbatches
    if pp not in pipeline_sizes(cluster):
        raise ValueError(f"pp={pp} must split the {cluster.world_size} ranks into stages of world / pp consecutive "
                         f"ranks that tile the {cluster.nodes} x {cluster.gpus_per_node} nodes: use one of "
                         f"{pipeline_sizes(cluster)}")
    if model.layers < stages:
        raise ValueError(f"pp={pp} with pp_schedule={plan.pp_schedule!r} makes {stages} stages and the model has "
                         f"{model.layers} layers: use a smaller pp, a schedule of fewer stages or more layers")
    if data_rank_tokens(model, pp) % microbatches:
        raise ValueError(f"microbatches={microbatches} must divide a data rank's {data_rank_tokens(model, pp)} tokens "
                         f"(the model's tokens_per_rank={model.tokens_per_rank} x pp={pp}: the same global batch "
                         "on world / pp data ranks), every micro-batch the same tokens")
    tokens = data_rank_tokens(model, pp) // microbatches
    micro = model.with_overrides(tokens_per_rank=tokens, sequence_length=min(model.sequence_length, tokens))
    blocks = math.ceil(model.layers / stages)
    return PipelineLayout(cluster.expert_group(cluster.world_size // pp), micro.with_overrides(layers=blocks),
                          micro.with_overrides(layers=blocks_per_rank(model.layers, plan)), stages, microbatches)


def stage_plan(plan: StepPlan) -> StepPlan:
    """The plan one stage runs, unpipelined, its gradients synced after the backward."""
    return replace(plan, pp=1, pp_schedule="1f1b", microbatches=None, pp_overlap=False, bucket_mb=math.inf)


def simulate_pipelined(cluster: Cluster, model: ModelSpec, plan: StepPlan, loads: list[LayerLoad] | None,
                       run: StageRun) -> tuple[PipelinedStep, PipelineLayout]:
    """Price ``plan``'s pipelined step. ``loads``: the whole model's on one expert group's ranks (the
    last stage's blocks are taken, a micro-batch's share of each); None: drawn for the stage."""
    layout = pipeline_layout(cluster, model, plan)
    inner, m = stage_plan(plan), layout.microbatches
    timeline, forward_ops = run(layout.stage_cluster, layout.stage_model, inner,
                                _micro_loads(loads, layout.stage_model.layers, m))
    per_rank = layout.rank_model.layers // layout.stage_model.layers  # stages a rank holds
    tail_timeline, tail_forward = (timeline, forward_ops) if per_rank == 1 else run(
        layout.stage_cluster, layout.rank_model, inner, _micro_loads(loads, layout.rank_model.layers, m))
    prices = stage_prices(timeline, forward_ops, cluster, layout.stage_model, plan)
    tail_s = tail_timeline.makespan() - _backward_end(tail_timeline, tail_forward)
    orders = stage_orders(plan.pp_schedule, plan.pp, m)
    times = simulate_stages(orders, prices.forward_s, prices.backward_s, prices.send_s, prices.weight_s,
                            prices.paired_s)
    every = range(len(timeline.ops))
    busy = {category: seconds * m * per_rank for category, seconds in _busy(timeline, _work(timeline, every)).items()}
    busy.update(_busy(tail_timeline, [i for i in range(len(tail_timeline.ops)) if _is_tail(tail_timeline, i)]))
    operations = len(timeline.ops) + (len(tail_timeline.ops) if per_rank > 1 else 0)
    dropped = m * per_rank * _dropped(loads, layout.stage_model, m)
    return PipelinedStep(times.step_s + tail_s, busy, dropped, operations, prices, tail_s, times), layout


def stage_prices(timeline: Timeline, forward_ops: int, cluster: Cluster, model: ModelSpec,
                 plan: StepPlan) -> StagePrices:
    """F, B, W, the pair and the send from one stage's micro-batch ``timeline``: F ends with its last
    forward operation, B with its last before the gradient sync. W is the backward GEMMs' share
    beyond the input gradient (which costs what the forward does: half of them at the device's
    backward ratio of 2, zero-bubble's usual split). The pair (``pp_overlap``) is DualPipe's ideal
    overlap: ``F + B - min(exposed_F, compute_B) - min(exposed_B, compute_F)``, where a pass's
    exposed all-to-all is its time beyond its compute, at most its all-to-alls' busy time."""
    forward, backward = range(forward_ops), _work(timeline, range(forward_ops, len(timeline.ops)))
    forward_s = _end(timeline, forward)
    backward_s = _backward_end(timeline, forward_ops) - forward_s
    f_busy, b_busy = _by_stream(timeline, forward), _by_stream(timeline, backward)
    gemm_s = sum(_busy(timeline, backward).get(category, 0.0) for category in GEMM_CATEGORIES)
    weight_s = gemm_s * max(0.0, 1.0 - 1.0 / cluster.device.backward_ratio)
    paired_s = None
    if plan.pp_overlap:
        exposed_f = min(f_busy[ALLTOALL], max(0.0, forward_s - f_busy[COMPUTE]))
        exposed_b = min(b_busy[ALLTOALL], max(0.0, backward_s - b_busy[COMPUTE]))
        paired_s = forward_s + backward_s - min(exposed_f, b_busy[COMPUTE]) - min(exposed_b, f_busy[COMPUTE])
    activation = model.tokens_per_rank * model.dims.model_dim * model.element_bytes
    return StagePrices(forward_s, backward_s, weight_s, paired_s, stage_send_s(cluster, activation, plan.pp))


def stage_send_s(cluster: Cluster, nbytes: float, pp: int) -> float:
    """Seconds for every rank of a stage to send ``nbytes`` to its peer in the next stage (the same
    place, world / pp ranks on). Stages tile the nodes, so on several nodes some boundary between
    stages is one between nodes: there the node's ranks of the stage send over its NICs at once
    (that slowest hop prices every send); on one node each rank sends over its own link."""
    if pp == 1:
        return 0.0
    if cluster.nodes > 1:
        senders = min(cluster.world_size // pp, cluster.gpus_per_node)
        return cluster.nic.latency_s + senders * (cluster.node_message_overhead_s() + nbytes / cluster.node_bandwidth)
    link = cluster.intra
    return link.latency_s + link.message_overhead_s + nbytes / link.bandwidth


def _micro_loads(loads: list[LayerLoad] | None, blocks: int, microbatches: int) -> list[LayerLoad] | None:
    """The last ``blocks`` layers' loads, each a micro-batch's share (None: drawn for the stage)."""
    if loads is None:
        return None
    if len(loads) < blocks:
        raise ValueError(f"{len(loads)} layers' loads given for a stage of {blocks} blocks: pass the whole model's")
    return [LayerLoad(load.counts / microbatches, load.experts, load.owners) for load in loads[-blocks:]]


def _dropped(loads: list[LayerLoad] | None, stage: ModelSpec, microbatches: int) -> float:
    """Assignments one stage's micro-batch drops (with loads given; drawn loads are balanced enough)."""
    micro = _micro_loads(loads, stage.layers, microbatches)
    return sum(load.dropped(stage) for load in micro) if micro else 0.0


def _is_tail(timeline: Timeline, index: int) -> bool:
    """Whether operation ``index`` is the step's once-per-step tail: the gradient sync or the optimizer."""
    op = timeline.ops[index]
    return op.stream == GRADIENTS or op.category == "optimizer"


def _work(timeline: Timeline, indices: Iterable[int]) -> list[int]:
    """``indices`` without the tail's operations."""
    return [i for i in indices if not _is_tail(timeline, i)]


def _end(timeline: Timeline, indices: Iterable[int]) -> float:
    return max((float(np.max(timeline.finish[i])) for i in indices), default=0.0)


def _backward_end(timeline: Timeline, forward_ops: int) -> float:
    """When the backward's last operation before the gradient sync ends."""
    return _end(timeline, _work(timeline, range(forward_ops, len(timeline.ops))))


def _spans(timeline: Timeline, indices: Iterable[int], key: Callable[[Any], str]) -> dict[str, float]:
    """Busy seconds of ``indices`` by ``key`` of their operation, as :meth:`Timeline.busy` counts them."""
    totals: dict[str, float] = {}
    for i in indices:
        name = key(timeline.ops[i])
        totals[name] = totals.get(name, 0.0) + float(np.mean(np.asarray(timeline.finish[i]) - timeline.start[i]))
    return totals


def _busy(timeline: Timeline, indices: Iterable[int]) -> dict[str, float]:
    return _spans(timeline, indices, lambda op: op.category)


def _by_stream(timeline: Timeline, indices: Iterable[int]) -> dict[str, float]:
    return {COMPUTE: 0.0, ALLTOALL: 0.0, **_spans(timeline, indices, lambda op: op.stream)}
