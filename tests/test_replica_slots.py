"""Lina's inference placement under a memory budget: each rank keeps its own experts and takes at
most R copies of hot ones (``moeflow.inference.plan.replica_slot_plan``)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.inference.plan import plan_loads, replica_slot_plan


def test_no_slots_is_expert_parallel() -> None:
    assert replica_slot_plan([9, 1, 1, 1], 2, 0) == [[0, 1], [2, 3]]


def test_the_hot_expert_is_copied_then_the_next_copy_evens_the_ranks() -> None:
    load = np.array([9.0, 1, 1, 1])
    plan = replica_slot_plan(load, 2, 1)
    # expert 0 on both ranks (6.5 on the busiest), then expert 2 on rank 0 (6 and 6)
    assert plan == [[0, 1, 2], [0, 2, 3]]
    assert plan_loads(plan, load) == pytest.approx([6.0, 6.0])


def test_no_copy_where_it_does_not_unload_the_busiest_rank() -> None:
    assert replica_slot_plan([1, 1, 1, 1], 2, 2) == [[0, 1], [2, 3]]


def test_at_most_r_copies_per_rank_and_owners_stay() -> None:
    plan = replica_slot_plan([100, 1, 1, 1, 1, 1, 1, 1], 4, 1)
    assert all(len(experts) <= 3 for experts in plan)
    assert sum(0 in experts for experts in plan) == 4  # the hot expert on every rank
    for rank, experts in enumerate(plan):
        assert {2 * rank, 2 * rank + 1} <= set(experts)  # its own experts stay


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="replica_slots must be an integer >= 0"):
        replica_slot_plan([1, 1], 2, -1)
    with pytest.raises(ValueError, match="3 experts cannot be split evenly over 2 ranks"):
        replica_slot_plan([1, 1, 1], 2, 1)
