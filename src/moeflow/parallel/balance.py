"""``balance='auto'``: a layer's load-balancing technique, chosen for its recorded load.

Each time the layer is rebalanced (the trainer's rebalancer, every ``rebalance_interval`` steps, or
:func:`moeflow.training.rebalance.rebalance_layer`), the cost model of :mod:`moeflow.perf.balance`
prices a training step of the layer under each technique for the load it recorded, and the layer
switches to the fastest: expert parallelism as placed (``off``), FasterMoE's shadowing with
Algorithm 1 each iteration (``shadowing``), or EPLB's slots placed for the load (``redundant``).
Every rank records the same global load and prices it with the same profile, so every rank
chooses alike. A change moves the weights and optimizer state once, like any placement change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.comm.topology import Topology
from moeflow.config import MoEConfig, ffn_projections
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.redundant import SlotSchedule, balanced_placement, slots_per_rank
from moeflow.parallel.schedules import ParallelSchedule
from moeflow.parallel.shadowing import ShadowedSchedule
from moeflow.parallel.wrapped import WrappingSchedule
from moeflow.perf import CostModel
from moeflow.perf.balance import OFF, REDUNDANT, SHADOWING, BalanceChoice, choose_balance
from moeflow.perf.shadowing import ShadowPrices


@dataclass(frozen=True)
class BalancedExecution:
    """What a layer runs after a balance choice: its schedule and placement, and the choice."""

    schedule: ParallelSchedule
    placement: ExpertPlacement
    choice: BalanceChoice


def base_schedule(schedule: ParallelSchedule) -> ParallelSchedule:
    """The schedule under the balancing techniques that wrap it."""
    while isinstance(schedule, WrappingSchedule):
        schedule = schedule.inner
    return schedule


def balance_mode(schedule: ParallelSchedule) -> str:
    """Which of the techniques ``schedule`` runs (what metrics and benchmarks report)."""
    if isinstance(schedule, SlotSchedule):
        return REDUNDANT
    return SHADOWING if isinstance(schedule, ShadowedSchedule) else OFF


def choose_execution(
    config: MoEConfig, schedule: ParallelSchedule, topology: Topology, cost: CostModel, load_E: Sequence[float],
) -> BalancedExecution:
    """The fastest technique for ``load_E`` (tokens per expert per step, all ranks together), and
    the schedule and placement that run it around the layer's base ``schedule``."""
    world, num_experts = topology.world_size, config.num_experts
    base = base_schedule(schedule)
    expert_parallel = base.placement(num_experts, world, config.hidden_dim)
    slots = balanced_placement(list(load_E), slots_per_rank(config.redundant_experts, num_experts, world),
                               topology, config.hidden_dim)
    tokens_WE = np.tile(np.asarray(load_E, dtype=np.float64) / world, (world, 1))  # each rank routes its share
    prices = ShadowPrices.from_cost_model(cost, config.model_dim, config.hidden_dim,
                                          ffn_projections(config.activation), wire_dtype=config.wire_dtype)
    choice = choose_balance(
        tokens_WE, [expert_parallel.holders(e)[0] for e in range(num_experts)], *slots.slots(), prices
    )
    if choice.mode == REDUNDANT:
        return BalancedExecution(SlotSchedule(base), slots, choice)
    if choice.mode == SHADOWING:
        shadowed = ShadowedSchedule(base, "auto", cost, config.model_dim, config.hidden_dim,
                                    ffn_projections(config.activation))
        return BalancedExecution(shadowed, expert_parallel, choice)
    assert choice.mode == OFF
    return BalancedExecution(base, expert_parallel, choice)
