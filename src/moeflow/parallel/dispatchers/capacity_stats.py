"""The :class:`~moeflow.core.stats.RoutingStats` a layer call reports: the global load after capacity,
the plan that ran and what the schedule said about its run."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from moeflow.comm.groups import ParallelGroups
from moeflow.config import MoEConfig, wire_row_bytes
from moeflow.core.stats import ExecutionPlan, PipelineTiming, RoutingStats
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.context import ScheduleOutput
from moeflow.parallel.online_planner import PlanChoice
from moeflow.parallel.token_share import OwnedTokens
from moeflow.perf.pipeline import capacity_chunks


def routing_stats(
    config: MoEConfig, groups: ParallelGroups, load: GlobalLoad, capacity: int, top_k: int, factor: float,
    chosen: PlanChoice, timing: PipelineTiming, label: str, owned: OwnedTokens, ran: ScheduleOutput,
    expert_kernel: str, kernels: dict[str, str] | None = None,
) -> RoutingStats | Callable[[], RoutingStats]:
    """``label``: the schedule's name for the plan that ran; ``owned``: the tokens this rank
    encoded (Parm's S1: its MP member's share, whose buffer and, partitioned, drops are its own);
    ``expert_kernel``: the call's experts' kernel (``expert_kernel="auto"`` resolved); ``kernels``:
    who ran encode, decode and the ragged GEMMs. Where the schedule's dedup totals
    are still on their way (an all-reduce the forward did not wait for), the statistics are a
    function that reads them on first read of ``MoELayer.last_stats``."""
    if ran.dedup_totals is not None:
        settled = dataclasses.replace(owned, x_TM=owned.x_TM[:0])  # its dtype, not its tokens, stays alive
        arguments = (config, groups, load, capacity, top_k, factor, chosen, timing, label, settled)
        return functools.partial(_after_totals, arguments, ran, expert_kernel, kernels)
    slots = owned.capacity
    counts_WE = load.counts_WE
    if groups.model is not None:  # MP members hold the same tokens: count them once
        counts_WE = counts_WE[:: dist.get_world_size(groups.model)]
    if owned.dropped_E is None:
        dropped_E = (counts_WE - capacity).clamp(min=0).sum(0).tolist()
    else:  # Parm's partitioned S1: each member dropped by its own partition's capacity
        capacity, dropped_E = owned.capacity, owned.dropped_E
    row_bytes = wire_row_bytes(config.wire_dtype, config.model_dim, owned.x_TM.element_size())
    plan = ExecutionPlan(
        schedule=label,
        r=chosen.plan.r,
        alltoall=chosen.plan.algorithm,
        pipeline_degree=len(capacity_chunks(slots, chosen.plan.degree)),
        requested_degree=chosen.plan.degree,
        policy=config.pipeline,
        source=chosen.source,
        world_size=groups.size,
        expert_kernel=expert_kernel,
        capacity_key=chosen.key,
        predicted_forward_s=chosen.predicted_forward_s,
        predicted_backward_s=chosen.predicted_backward_s,
        predicted_gradient_sync_s=chosen.predicted_gradient_sync_s,
        trial_cost_s=chosen.trial_cost_s,
        slots=slots,
        token_exchange=chosen.plan.exchange,
        kernels=kernels or {},
    )
    return RoutingStats(
        num_tokens=int(counts_WE.sum()) // top_k,
        top_k=top_k,
        capacity=capacity,
        capacity_factor=factor,
        tokens_per_expert=counts_WE.sum(0).tolist(),
        dropped_per_expert=dropped_E,
        plan=plan,
        timing=timing,
        shadowed_experts=ran.shadowed_experts,
        shadow_predicted_gain_s=ran.shadow_predicted_gain_s,
        rank_tokens=ran.rank_tokens,
        cross_node_rows=ran.cross_node_rows,
        dedup_saved_rows=ran.dedup_saved_rows,
        dedup_saved_bytes=None if ran.dedup_saved_rows is None else 2 * ran.dedup_saved_rows * row_bytes,
    )


def _after_totals(
    arguments: tuple[Any, ...], ran: ScheduleOutput, expert_kernel: str, kernels: dict[str, str] | None
) -> RoutingStats:
    """The statistics once a dedup exchange's totals are read (they wait for their all-reduce here)."""
    assert ran.dedup_totals is not None
    saved, crossed = ran.dedup_totals()
    read = dataclasses.replace(ran, dedup_totals=None, dedup_saved_rows=saved, cross_node_rows=crossed)
    stats = routing_stats(*arguments, read, expert_kernel, kernels)
    assert isinstance(stats, RoutingStats)
    return stats
