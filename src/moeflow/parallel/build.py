"""The execution a layer's settings describe, decided once when it is built: its schedule (with
the techniques that wrap it), where the weights live, the all-to-alls its planner may pick and
FasterMoE's topology-aware gate. Which techniques combine is the registry's rule
(:func:`moeflow.parallel.registry.check_techniques`); the checks that depend on the group run
here, so the layer only assembles what this module returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.comm.algorithms import distinct_algorithms
from moeflow.comm.groups import ParallelGroups
from moeflow.config import ALLTOALL_ALGORITHMS, FASTERMOE_REMOTE_SHARE, SAA, MoEConfig, ffn_projections
from moeflow.core.capacity import estimated_needed_capacity
from moeflow.core.routing import NodeLimit, expert_capacity
from moeflow.parallel.parm import check_mp_group
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.redundant import SlotSchedule, balanced_placement, slots_per_rank
from moeflow.parallel.registry import (
    AUTO,
    MODEL_PARALLEL_SCHEDULES,
    ShardingLayout,
    check_techniques,
    dedup_allowed,
    select_schedule,
)
from moeflow.parallel.schedules import ParallelSchedule
from moeflow.parallel.shadowing import ShadowedSchedule, check_shadowing
from moeflow.parallel.smart import check_smart_pipeline
from moeflow.perf import CostModel
from moeflow.perf.shape import RegionShape


@dataclass(frozen=True)
class Execution:
    """What :func:`build_execution` decides for a layer."""

    schedule: ParallelSchedule
    reason: str  # why select_schedule chose it ("forced", "default", "layout", "model", "mp_group")
    placement: ExpertPlacement
    algorithms: tuple[str, ...]  # the all-to-alls the planner may pick
    node_limit: NodeLimit | None  # the topology-aware gate of this rank, or None


def region_shape(
    config: MoEConfig, world_size: int, capacity: int, bytes_per_element: int, tokens: int = 0, needed: int = 0
) -> RegionShape:
    """The planner's shape of one layer call at ``capacity`` slots per expert."""
    return RegionShape(config.dims, world_size, capacity, bytes_per_element, tokens, needed, config.wire_dtype)


def build_execution(config: MoEConfig, groups: ParallelGroups, cost_model: CostModel | None) -> Execution:
    """The schedule, its placement and the planner's algorithms for ``config`` on ``groups``."""
    _check_alltoall(config, groups)
    mp_size = check_mp_group(groups) if groups.model is not None else 1
    algorithms = candidate_algorithms(config, groups, cost_model, mp_size > 1)
    choice = select_schedule(
        config.parallel, config.num_experts, groups.size, cost_model,
        _hint_shape(config, groups.size, cost_model, algorithms), algorithms, config.pipeline,
        ShardingLayout(mp_size, config.esp_size, config.token_exchange,
                       config.token_exchange == AUTO and dedup_allowed(config)),
    )
    schedule = choice.schedule
    check_techniques(config, schedule.name)
    placement = schedule.placement(config.num_experts, groups.size, config.hidden_dim)
    check_balance(config.balance, cost_model)
    if config.redundant_experts and config.balance == "fixed":  # EPLB's slots, for an even load until rebalanced
        slots = slots_per_rank(config.redundant_experts, config.num_experts, groups.size)
        placement = balanced_placement([1.0] * config.num_experts, slots, groups.topology, config.hidden_dim)
        schedule = SlotSchedule(schedule)
    check_smart_pipeline(config.pipeline, groups)
    check_shadowing(config.shadowing, cost_model)
    if config.shadowing != "off":
        schedule = ShadowedSchedule(
            schedule, config.shadowing, cost_model, config.model_dim, config.hidden_dim,
            ffn_projections(config.activation),
        )
    node_limit = topology_node_limit(config, placement, groups, cost_model)
    return Execution(schedule, choice.reason, placement, algorithms, node_limit)


def check_balance(balance: str, cost_model: CostModel | None) -> None:
    """``balance='auto'`` prices its choice with a calibrated profile; until the first rebalance
    the layer runs expert parallelism as placed (what the choice gives an even load)."""
    if balance == "auto" and cost_model is None:
        raise ValueError(
            "balance='auto' chooses among off, shadowing and redundant slots with the cost model: pass "
            "profile=<a calibrated cluster profile> (moeflow calibrate), or balance='fixed'"
        )


def attach_mp_group(groups: ParallelGroups, mp_group: dist.ProcessGroup | None, parallel: str | int) -> None:
    """Parm's schedules run behind tensor-parallel attention over ``mp_group`` (``auto`` then
    chooses between S1 and S2); the others have no use for one."""
    if mp_group is None:
        if parallel in MODEL_PARALLEL_SCHEDULES and groups.model is None:
            raise ValueError(f"parallel={parallel!r} needs mp_group=<the tensor-parallel group of the attention>")
        if groups.model is not None and parallel not in (*MODEL_PARALLEL_SCHEDULES, AUTO):
            raise ValueError(
                f"the ParallelGroups passed as group have a model (tensor-parallel) group, which only Parm's "
                f"schedules use; got parallel={parallel!r}: use 'auto' or one of {MODEL_PARALLEL_SCHEDULES}"
            )
        return
    if parallel not in (*MODEL_PARALLEL_SCHEDULES, AUTO):
        raise ValueError(
            f"mp_group is used by Parm's schedules (parallel='auto' or "
            f"{' or '.join(map(repr, MODEL_PARALLEL_SCHEDULES))}); got parallel={parallel!r}"
        )
    if groups.model is not None and groups.model != mp_group:
        raise ValueError("mp_group differs from the model group of the ParallelGroups passed as group")
    groups.model = mp_group


def _check_alltoall(config: MoEConfig, groups: ParallelGroups) -> None:
    if config.alltoall == SAA and groups.model is None:
        raise ValueError(
            "alltoall='saa' overlaps Parm's S2 combine with the MP all-gather: it needs parallel='s2' or "
            "'auto' with mp_group=<the tensor-parallel group>; use alltoall='linear' or 'auto'"
        )
    if config.alltoall not in ("linear", SAA, "auto") and groups.size > 1 and not groups.knows_nodes:
        raise ValueError(
            f"alltoall={config.alltoall!r} needs the expert group's node layout, which this custom group lacks: "
            f"{groups.node_layout_problem}; or use alltoall='linear' with a custom group"
        )


def candidate_algorithms(
    config: MoEConfig, groups: ParallelGroups, cost_model: CostModel | None, behind_mp: bool
) -> tuple[str, ...]:
    """The all-to-alls the planner may pick: the forced one; behind tensor-parallel attention,
    Parm's plain and overlapped (SAA) combines; linear on a custom group; those a profile
    measured; otherwise those that differ from linear on this topology."""
    if config.alltoall != "auto":
        return (config.alltoall,)
    if behind_mp:
        return ("linear", SAA)
    if not groups.knows_nodes:
        return ("linear",)
    if cost_model is not None and config.pipeline != "search":
        return ALLTOALL_ALGORITHMS
    return distinct_algorithms(groups.topology)


def _hint_shape(
    config: MoEConfig, world_size: int, cost: CostModel | None, algorithms: tuple[str, ...]
) -> RegionShape | None:
    """The region at ``tokens_per_rank_hint`` tokens (balanced load), for ``parallel='auto'``;
    None when the profile cannot predict the expert schedule."""
    fits = cost.profile.fits if cost is not None else {}
    hint = config.tokens_per_rank_hint
    if hint is None or "gemm" not in fits or not any(f"alltoall.{a}" in fits for a in algorithms):
        return None
    needed = estimated_needed_capacity(config.top_k, hint, config.num_experts)
    capacity = expert_capacity(config.capacity_factor, config.top_k, hint, config.num_experts, needed)
    return region_shape(config, world_size, capacity, 4)


def topology_node_limit(
    config: MoEConfig, placement: ExpertPlacement, groups: ParallelGroups, cost: CostModel | None
) -> NodeLimit | None:
    """FasterMoE's topology-aware gate for this rank: the experts on its node and the share of
    its tokens that may pick others (``topology_gate``, or W_net / (M W_local) from the profile)."""
    setting = config.topology_gate
    if setting == "off":
        return None
    if groups.size > 1 and not groups.knows_nodes:  # one node, as far as it knows: it would limit nothing
        raise ValueError(
            "topology_gate limits the tokens sent to other nodes, and this layer's custom group has no node layout: "
            f"{groups.node_layout_problem}; or use topology_gate='off'"
        )
    share = setting if setting != "auto" else (cost.remote_token_share() if cost is not None else None)
    if share is None:
        raise ValueError(
            "topology_gate='auto' takes W_net / (M W_local) from a profile with intra- and inter-node all-to-all "
            "fits (calibrated with 2+ ranks per node): pass such a profile or the share itself, e.g. "
            f"topology_gate={FASTERMOE_REMOTE_SHARE}"
        )
    node = groups.topology.node_of(groups.rank)
    local_E = torch.tensor([
        groups.topology.node_of(placement.holders(expert)[0]) == node for expert in range(config.num_experts)
    ])
    return NodeLimit(local_E, float(share))
