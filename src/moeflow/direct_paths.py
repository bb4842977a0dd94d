"""The direct paths of a small no-grad forward, chosen in one place, and what their statistics say.

A forward with no backward (generation, evaluation) that the capacity path would not drop from
needs no capacity buffer: on a rank that holds every expert its tokens stay home
(:mod:`moeflow.direct`); under expert parallelism they ride the load all-gather at decode sizes
(:mod:`moeflow.direct_gather`) or travel in one ragged all-to-all each way
(:mod:`moeflow.direct_exchange`). The schedule says which applies (``ParallelSchedule.direct_path``);
:func:`run_direct` decides from the load every rank holds alike, so no rank skips a collective
another runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import Topology, cross_node_rows, gathered_cross_node_rows
from moeflow.config import RAGGED
from moeflow.direct import DIRECT_LOCAL, SOURCE, STAYS_HOME, direct_experts
from moeflow.direct_exchange import DIRECT_EXCHANGE_ROWS, exchanged_experts
from moeflow.direct_gather import GATHERED, bucket_after, gather_load, gathered_output
from moeflow.direct_packed import DIRECT_PACKED, packed_experts_output
from moeflow.experts import ExpertFFN
from moeflow.kernels.choice import KernelChoice
from moeflow.routing.load import GlobalLoad
from moeflow.routing.router import Routing
from moeflow.stats import ExecutionPlan, PipelineTiming, RoutingStats


@dataclass(frozen=True)
class DirectRun:
    """A no-grad forward's direct path: its output, or None where it declined (the capacity path then
    runs with ``load``, which every rank holds alike); how the tokens travelled; and the bucket the
    layer's next load all-gather carries."""

    y_TM: torch.Tensor | None
    load: GlobalLoad
    exchange: str = STAYS_HOME
    next_bucket: int = 0


def run_direct(
    path: str, x_TM: torch.Tensor, routing: Routing, top_k: int, capacity_factor: float, experts: ExpertFFN,
    groups: ParallelGroups, kernels: KernelChoice, bucket: int, timing: PipelineTiming, direct: bool = True,
) -> DirectRun:
    """The schedule's direct ``path``: on one rank with every expert, the local experts (the layer
    took it only for a no-grad forward where nothing can drop), or their packed path (a forward with
    backward under the ragged kernel, :mod:`moeflow.direct_packed`). Under expert parallelism every
    forward's load all-gather goes through here, carrying whether this rank asks for a direct path
    (``direct``: a no-grad forward) and up to ``bucket`` tokens per rank. Where every rank asked and
    the capacity path would drop nothing, tokens that all came along run gathered, and up to
    :data:`DIRECT_EXCHANGE_ROWS` rows per rank run the direct exchange. ``timing`` gets the region's
    time. The ragged GEMMs run on ``kernels.gemm``."""
    choice, counts_E, backend = routing.choice, routing.counts_E, kernels.gemm
    if path == DIRECT_LOCAL:
        y_TM = direct_experts(x_TM, choice.expert_idx_TK, choice.weights_TK, counts_E, experts, backend)
        return DirectRun(y_TM, GlobalLoad(counts_E.unsqueeze(0), x_TM.shape[0]))
    if path == DIRECT_PACKED:
        load = GlobalLoad(counts_E.cpu().unsqueeze(0), x_TM.shape[0])
        capacity = load.capacity(capacity_factor, top_k)
        slotted = routing.slotted(counts_E.numel())
        return DirectRun(packed_experts_output(x_TM, slotted, load.counts_WE[0], capacity, experts, kernels), load)
    gathered = gather_load(x_TM, choice.expert_idx_TK, choice.weights_TK, counts_E, groups, bucket, direct)
    load = gathered.load
    if not gathered.all_direct or load.capacity(capacity_factor, top_k) < load.needed_capacity:
        return DirectRun(None, load)  # the capacity path; the next gather carries no tokens it could not use
    following = bucket_after(load)
    if gathered.tokens is not None:
        y_TM = gathered_output(gathered.tokens, load.counts_WE, experts, groups, backend, timing)
        return DirectRun(y_TM, load, GATHERED, following)
    if load.max_tokens_per_rank * top_k <= DIRECT_EXCHANGE_ROWS:
        y_TM = exchanged_experts(x_TM, choice.expert_idx_TK, choice.weights_TK, load.counts_WE, experts, groups,
                                 backend, timing)
        return DirectRun(y_TM, load, RAGGED, following)
    return DirectRun(None, load, next_bucket=following)


def direct_stats(
    load: GlobalLoad, top_k: int, capacity_factor: float, schedule: str, policy: int | str,
    topology: Topology | None = None, timing: PipelineTiming | None = None, exchange: str = STAYS_HOME,
    kernels: dict[str, str] | None = None,
) -> RoutingStats:
    """What a direct forward reports (on first read of ``MoELayer.last_stats``): every rank's counts
    (one row on one rank), the assignments beyond capacity (only the packed path keeps fewer than
    all), one "chunk", how the tokens travelled (``exchange``) over ``topology``, in ``timing``, and
    the ``kernels`` that ran."""
    counts_WE = load.counts_WE.cpu()
    world = counts_WE.shape[0]
    capacity = load.capacity(capacity_factor, top_k)
    plan = ExecutionPlan(schedule=schedule, alltoall="none" if world == 1 else "linear", pipeline_degree=1,
                         requested_degree=1, policy=policy, source=SOURCE, world_size=world, expert_kernel="ragged",
                         slots=capacity, token_exchange=exchange, kernels=kernels or {})
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
