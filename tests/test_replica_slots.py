"""Lina's inference placement under a memory budget: each rank keeps its own experts and takes at
most R copies of hot ones (``moeflow.inference.assignment.replica_slot_plan``)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.inference.assignment import assignment_loads, replica_slot_assignment
from moeflow.inference.cost import PlanPrice, ReplicaPrices
from moeflow.perf import LinkPrices


def test_no_slots_is_expert_parallel() -> None:
    assert replica_slot_assignment([9, 1, 1, 1], 2, 0) == [[0, 1], [2, 3]]


def test_the_hot_expert_is_copied_then_the_next_copy_evens_the_ranks() -> None:
    load = np.array([9.0, 1, 1, 1])
    plan = replica_slot_assignment(load, 2, 1)
    # expert 0 on both ranks (6.5 on the busiest), then expert 2 on rank 0 (6 and 6)
    assert plan == [[0, 1, 2], [0, 2, 3]]
    assert assignment_loads(plan, load) == pytest.approx([6.0, 6.0])


def test_no_copy_where_it_does_not_unload_the_busiest_rank() -> None:
    assert replica_slot_assignment([1, 1, 1, 1], 2, 2) == [[0, 1], [2, 3]]


def test_at_most_r_copies_per_rank_and_owners_stay() -> None:
    plan = replica_slot_assignment([100, 1, 1, 1, 1, 1, 1, 1], 4, 1)
    assert all(len(experts) <= 3 for experts in plan)
    assert sum(0 in experts for experts in plan) == 4  # the hot expert on every rank
    for rank, experts in enumerate(plan):
        assert {2 * rank, 2 * rank + 1} <= set(experts)  # its own experts stay


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="replica_slots must be an integer >= 0"):
        replica_slot_assignment([1, 1], 2, -1)
    with pytest.raises(ValueError, match="3 experts cannot be split evenly over 2 ranks"):
        replica_slot_assignment([1, 1, 1], 2, 1)


# -- whether a copy pays (moeflow.inference.cost) ---------------------------------------------------

def _prices(seconds_per_byte: float) -> ReplicaPrices:
    """1 ms per token of expert compute, 10-byte rows, 1000-byte experts, one rank per node."""
    return ReplicaPrices(0.0, 1e-3, LinkPrices(1, seconds_per_byte, 0.0), 10, 1000)


STORAGE = [[0, 1], [2, 3]]
LOAD = np.array([30.0, 10.0, 0.0, 0.0])  # rank 0 computes 40 ms, rank 1 nothing


def test_the_prices_add_compute_exchange_and_the_copies_beyond_what_hides_them() -> None:
    prices, copied = _prices(1e-4), [[0, 1], [0, 2, 3]]
    assert prices.compute_seconds(STORAGE, LOAD) == pytest.approx(0.040)
    assert prices.compute_seconds(copied, LOAD) == pytest.approx(0.025)  # expert 0's 30 tokens split 15 / 15
    # static: rank 1 sends half of the 40 tokens to rank 0 and takes them back, 200 bytes each way
    assert prices.exchange_seconds(STORAGE, LOAD) == pytest.approx(2 * 200 * 1e-4)
    assert prices.copy_seconds(copied, STORAGE) == pytest.approx(1000 * 1e-4)
    assert prices.copy_seconds(STORAGE, STORAGE) == 0.0
    total = prices.seconds(copied, LOAD, STORAGE, hidden_s=0.06)
    assert total == pytest.approx(0.025 + prices.exchange_seconds(copied, LOAD) + 0.04)


@pytest.mark.parametrize(("seconds_per_byte", "hidden_s", "copies"), [
    (1e-6, 0.0, True),  # a fast link: the copy's 1 ms buys 15 ms of compute
    (1e-4, 0.0, False),  # a slow link on the critical path: 100 ms for 15 ms, the plan stays static
    (1e-4, 0.095, True),  # the same copy fetched a layer ahead, under 95 ms of compute: 5 ms for 15 ms
])
def test_a_copy_is_made_only_where_it_pays(seconds_per_byte: float, hidden_s: float, copies: bool) -> None:
    prices = _prices(seconds_per_byte)
    plan = replica_slot_assignment(LOAD, 2, 1, PlanPrice(prices, LOAD, STORAGE, hidden_s))
    assert plan == ([[0, 1], [0, 2, 3]] if copies else STORAGE)
    # the bound that skips the search: the cheapest copy (100 ms on the slow link) against the most
    # copies could save (compute down to the mean, 20 ms, and the whole 40 ms exchange)
    assert prices.copy_may_pay(LOAD, STORAGE, hidden_s) == copies


@pytest.mark.parametrize("hides_copies", [True, False])
def test_a_copy_fetched_ahead_hides_under_compute_only_where_the_device_moves_it(hides_copies: bool) -> None:
    """A GPU moves a layer-ahead copy on its own engine while the layer computes; a CPU rank's
    core moves it itself, so there the copy is charged in full."""
    from moeflow.config import LayerDims
    from moeflow.inference import InferenceScheduler, SchedulerSettings
    from moeflow.inference.assignment import assignment_placement
    from moeflow.parallel.placement import ExpertPlacement
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel

    cluster = ClusterProfile(nodes=2, ranks_per_node=1, fits={
        "alltoall.linear": AlphaBeta(0.0, 1e-9), "ffn.forward": AlphaBeta(0.0, 1e-9), "gemm": AlphaBeta(0.0, 1e-12)})
    scheduler = InferenceScheduler(SchedulerSettings("oracle", replica_slots=1), 2, cost=CostModel(cluster))
    storage = ExpertPlacement.expert_parallel(4, 2, 8)
    scheduler.attach(0, lambda placement: None, storage, LayerDims(4, 8, 4, projections=2), 4,  # type: ignore[arg-type,return-value]
                     hides_copies=hides_copies)
    placement = assignment_placement(STORAGE, 4, 8)
    compute = scheduler._attached[0].prices.compute_seconds(STORAGE, LOAD)  # type: ignore[union-attr]
    assert compute > 0
    assert scheduler.hiding_seconds(0, placement, LOAD) == (compute if hides_copies else 0.0)
    assert scheduler.pricing(0, LOAD, 0.01).hidden_s == 0.01  # type: ignore[union-attr]
