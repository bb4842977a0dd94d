"""What the dispatchers that skip the capacity buffer (local, kept rows, gathered, row exchange)
share: their call and their statistics (the capacity dispatcher's are
:mod:`moeflow.parallel.dispatchers.capacity_stats`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from moeflow.comm.topology import Topology, cross_node_rows, gathered_cross_node_rows
from moeflow.core.routing.router import Routing
from moeflow.core.stats import ExecutionPlan, PipelineTiming, RoutingStats
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.dispatchers.protocol import LayerCall, Stats

SOURCE = "direct"
"""The plan source the statistics name for a forward that skipped the capacity buffer."""
STAYS_HOME = "none"
"""The token exchange the statistics name for a forward whose tokens never left their rank."""
GATHERED = "gathered"
"""The token exchange the statistics name for a forward whose tokens came with the load agreement."""


@dataclass(frozen=True)
class DirectLabels:
    """What the statistics name besides the load: the layer's schedule, its pipeline policy, and the
    topology the cross-node rows are counted over (None: one node)."""

    schedule: str
    policy: int | str
    topology: Topology | None = None


class DirectDispatcher:
    """What the dispatchers that skip the capacity buffer share: a dispatch that lays nothing out
    (the rows are the tokens, :class:`DirectDispatch`) and their statistics. Each runs its tokens
    to the experts and back in one step, :meth:`experts_output`."""

    labels: DirectLabels
    exchange: ClassVar[str] = STAYS_HOME  # how the tokens travelled, as the statistics name it
    expert_kernel: ClassVar[str] = "ragged"  # how the experts ran, as the statistics name it
    source: ClassVar[str] = SOURCE  # the plan source the statistics name

    def dispatch(self, call: LayerCall, routing: Routing, load: GlobalLoad) -> DirectDispatch:
        return DirectDispatch(self, call, routing, load, call.x_TM, PipelineTiming())

    def experts_output(self, call: LayerCall, routing: Routing, load: GlobalLoad, x_TM: torch.Tensor,
                       timing: PipelineTiming) -> torch.Tensor:
        raise NotImplementedError

    def stats(self, call: LayerCall, load: GlobalLoad, timing: PipelineTiming) -> Stats:
        return skipped_buffer(call, load, self.labels, timing, self.exchange, self.expert_kernel, self.source)


@dataclass
class DirectDispatch:
    """A call of a dispatcher that skips the buffer: its rows are the tokens themselves, its
    experts' step is the whole trip (:meth:`DirectDispatcher.experts_output`), its combine returns it."""

    dispatcher: DirectDispatcher
    call: LayerCall
    routing: Routing
    load: GlobalLoad
    rows: torch.Tensor
    timing: PipelineTiming

    def experts(self, rows: torch.Tensor) -> torch.Tensor:
        return self.dispatcher.experts_output(self.call, self.routing, self.load, rows, self.timing)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def stats(self) -> Stats:
        return self.dispatcher.stats(self.call, self.load, self.timing)


def skipped_buffer(call: LayerCall, load: GlobalLoad, labels: DirectLabels, timing: PipelineTiming,
                   exchange: str, expert_kernel: str, source: str) -> Stats:
    """The statistics of a call that skipped the capacity buffer (:func:`direct_stats`), computed on
    first read; none for a recompute."""
    if call.recompute:
        return None
    return functools.partial(direct_stats, load, call.top_k, call.capacity_factor, labels, timing, exchange,
                             call.kernels.as_dict(), expert_kernel=expert_kernel, source=source)


def direct_stats(
    load: GlobalLoad, top_k: int, capacity_factor: float, labels: DirectLabels, timing: PipelineTiming | None = None,
    exchange: str = STAYS_HOME, kernels: dict[str, str] | None = None, *, expert_kernel: str, source: str,
) -> RoutingStats:
    """What a forward without the capacity buffer reports (on first read of ``MoELayer.last_stats``):
    every rank's counts (one row on one rank), the assignments beyond capacity (only the kept-rows path
    keeps fewer than all), one "chunk", how the tokens travelled (``exchange``) over the labels'
    topology, in ``timing``, the ``kernels`` that ran, the ``expert_kernel`` and the plan's ``source``."""
    schedule, policy, topology = labels.schedule, labels.policy, labels.topology
    counts_WE = load.counts_WE.cpu()
    world = counts_WE.shape[0]
    capacity = load.capacity(capacity_factor, top_k)
    plan = ExecutionPlan(schedule=schedule, alltoall="none" if world == 1 else "linear", pipeline_degree=1,
                         requested_degree=1, policy=policy, source=source, world_size=world,
                         expert_kernel=expert_kernel, slots=capacity, token_exchange=exchange, kernels=kernels or {})
    tokens_W = (counts_WE.sum(1) // top_k).tolist()
    dropped_E = (counts_WE - capacity).clamp(min=0).sum(0).tolist()
    return RoutingStats(num_tokens=sum(tokens_W), top_k=top_k, capacity=capacity, capacity_factor=capacity_factor,
                        tokens_per_expert=counts_WE.sum(0).tolist(), dropped_per_expert=dropped_E, plan=plan,
                        rank_tokens=tuple(counts_WE.clamp(max=capacity).sum(0).view(world, -1).sum(1).tolist()),
                        cross_node_rows=_cross_node_rows(counts_WE, tokens_W, capacity, topology, exchange),
                        timing=PipelineTiming() if timing is None else timing)


def _cross_node_rows(
    counts_WE: torch.Tensor, tokens_W: list[int], capacity: int, topology: Topology | None, exchange: str
) -> int:
    """The token rows the dispatch sent between nodes: every gathered token to each rank of another
    node, or each exchanged row held on another node; none where the tokens stayed home."""
    if topology is None or exchange == STAYS_HOME:
        return 0
    if exchange == GATHERED:
        return gathered_cross_node_rows(tokens_W, topology)
    return cross_node_rows(counts_WE, capacity, True, topology)
