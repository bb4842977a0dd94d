"""The pipeline schedules' prices against their closed forms: GPipe's and 1F1B's step is
(M + P - 1)(F + B), Megatron's interleaved 1F1B's (v M + P - 1)(F + B) / v for stages of 1 / v of
a rank's blocks; DualPipeV's bubble is DeepSeek's published one; the V orders are torch's; a send
between ranks adds to the critical path, never to a rank's busy time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from moeflow.perf.stage_schedule import (
    BACKWARD,
    FORWARD,
    INPUT,
    WEIGHT,
    OrderItem,
    Paired,
    StageAction,
    StageCosts,
    actions_of,
    simulate_stage_costs,
    simulate_stages,
    stage_orders,
)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp_size", "microbatches"), [(2, 2), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_gpipe_and_1f1b_take_the_closed_form(schedule: str, pp_size: int, microbatches: int) -> None:
    forward, backward = 1.0, 2.0
    times = simulate_stages(stage_orders(schedule, pp_size, microbatches), forward, backward)
    assert times.step_s == pytest.approx((microbatches + pp_size - 1) * (forward + backward))
    assert times.bubble == pytest.approx((pp_size - 1) / (microbatches + pp_size - 1))


@pytest.mark.parametrize(("pp_size", "microbatches", "chunks"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaved_takes_megatrons_closed_form(pp_size: int, microbatches: int, chunks: int) -> None:
    forward, backward = 1.0 / chunks, 2.0 / chunks  # a stage holds 1 / v of the rank's blocks
    times = simulate_stages(stage_orders("interleaved", pp_size, microbatches, chunks), forward, backward)
    assert times.step_s == pytest.approx((chunks * microbatches + pp_size - 1) * (forward + backward))
    one_f1b = simulate_stages(stage_orders("1f1b", pp_size, microbatches), 1.0, 2.0)
    assert times.bubble < one_f1b.bubble  # the point of interleaving


def test_every_order_runs_each_stage_forward_and_backward_once_per_microbatch() -> None:
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        orders = stage_orders(schedule, 4, 8, chunks)
        actions = [action for order in orders for action in order]
        assert len(actions) == len(set(actions)) == 2 * 4 * chunks * 8
        assert {a.kind for a in actions} == {FORWARD, BACKWARD}


def test_a_send_between_ranks_lengthens_the_step_not_the_work() -> None:
    plain = simulate_stages(stage_orders("1f1b", 4, 8), 1.0, 2.0)
    sent = simulate_stages(stage_orders("1f1b", 4, 8), 1.0, 2.0, send_s=0.5)
    assert sent.busy_s == plain.busy_s and sent.step_s > plain.step_s
    assert sent.step_s >= plain.step_s + 2 * 3 * 0.5  # the first forward and last backward cross 3 links each


def test_orders_that_wait_on_each_other_are_refused() -> None:
    orders = stage_orders("gpipe", 2, 2)
    orders[1] = list(reversed(orders[1]))  # its backward first: before the forward it needs
    with pytest.raises(ValueError, match="wait on each other"):
        simulate_stages(orders, 1.0, 1.0)
    with pytest.raises(ValueError, match="multiple of pp_size"):
        stage_orders("interleaved", 4, 6)
    with pytest.raises(ValueError, match="zbv and dualpipev are"):
        stage_orders("chimera", 2, 4)
    with pytest.raises(ValueError, match="at least the 4 stages"):
        stage_orders("dualpipev", 2, 3)


_KINDS = {"FORWARD": FORWARD, "FULL_BACKWARD": BACKWARD, "BACKWARD_INPUT": INPUT, "BACKWARD_WEIGHT": WEIGHT}


def _torchs_order(runtime: type, rank: int, pp_size: int, microbatches: int) -> list[OrderItem]:
    """torch's own order of one rank (its schedule's generator, given the sizes it reads)."""
    sizes = SimpleNamespace(pp_group_size=pp_size, _n_microbatches=microbatches, num_stages=2 * pp_size)

    def action(a: Any) -> StageAction:
        return StageAction(_KINDS[a.computation_type.name], a.stage_index, a.microbatch_index)

    return [Paired(*map(action, a.sub_actions)) if a.sub_actions else action(a)
            for a in runtime._calculate_single_rank_operations(sizes, rank) if a is not None]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_v_orders_are_torchs(schedule: str) -> None:
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    runtime = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[schedule]
    for pp_size in (1, 2, 3, 4):
        for microbatches in sorted({2 * pp_size, 2 * pp_size + 1, 3 * pp_size, 8, 12}):
            expected = [_torchs_order(runtime, rank, pp_size, microbatches) for rank in range(pp_size)]
            assert stage_orders(schedule, pp_size, microbatches) == expected, (pp_size, microbatches)


@pytest.mark.parametrize("pp_size", [2, 3, 4, 6])
@pytest.mark.parametrize("paired", [3.0, 2.5, 2.0])
def test_dualpipev_takes_deepseeks_published_bubble(pp_size: int, paired: float) -> None:
    """DualPipe's table: (S/2 - 1)(F&B + B - 3W) over S = 2P stages, for F = B/2 = W (the table's
    symmetric case), from a pair run one after the other (F&B = F + B) to one whose overlap hides
    the forward (F&B = B); the most idle rank waits exactly that."""
    for microbatches in (2 * pp_size, 3 * pp_size, 20):
        times = simulate_stages(stage_orders("dualpipev", pp_size, microbatches), 1.0, 2.0, weight_s=1.0,
                                paired_s=paired)
        idle = max(times.step_s - busy for busy in times.busy_s)
        assert idle == pytest.approx((pp_size - 1) * (paired + 2.0 - 3 * 1.0))


def test_the_overlap_shortens_dualpipev_by_at_least_what_a_ranks_pairs_hide() -> None:
    orders = stage_orders("dualpipev", 2, 8)
    apart = simulate_stages(orders, 1.0, 2.0, weight_s=1.0)
    overlapped = simulate_stages(orders, 1.0, 2.0, weight_s=1.0, paired_s=2.4)
    pairs = [sum(isinstance(item, Paired) for item in order) for order in orders]
    for rank, count in enumerate(pairs):  # each pair's work is 0.6 shorter: each rank's busy time, by its pairs
        assert apart.busy_s[rank] - overlapped.busy_s[rank] == pytest.approx(count * 0.6)
    assert apart.step_s - overlapped.step_s >= max(pairs) * 0.6 - 1e-9
    assert simulate_stages(orders, 1.0, 2.0, weight_s=1.0, paired_s=3.0) == apart


def test_every_v_order_runs_each_stage_once_per_microbatch() -> None:
    for schedule in ("zbv", "dualpipev"):
        actions = [action for order in stage_orders(schedule, 3, 9) for item in order for action in actions_of(item)]
        forwards = [(a.stage, a.microbatch) for a in actions if a.kind == FORWARD]
        inputs = [(a.stage, a.microbatch) for a in actions if a.kind in (BACKWARD, INPUT)]
        weights = [(a.stage, a.microbatch) for a in actions if a.kind in (BACKWARD, WEIGHT)]
        everything = sorted((stage, m) for stage in range(6) for m in range(9))
        assert sorted(forwards) == sorted(inputs) == sorted(weights) == everything


@pytest.mark.parametrize("microbatches", [2, 4, 9])
def test_a_slower_stage_bounds_1f1b_and_equal_costs_price_as_before(microbatches: int) -> None:
    """Stage 1 (F 2, B 4) slower than stage 0 (F 1, B 2): 1F1B's step is stage 0's forward, M of
    stage 1's F + B, then stage 0's backward; equal per-stage costs give simulate_stages' times."""
    orders = stage_orders("1f1b", 2, microbatches)
    slow = simulate_stage_costs(orders, [StageCosts(1.0, 2.0), StageCosts(2.0, 4.0)])
    assert slow.step_s == pytest.approx(1.0 + microbatches * 6.0 + 2.0)
    assert slow.busy_s == (microbatches * 3.0, microbatches * 6.0)
    orders = stage_orders("dualpipev", 2, 8)
    equal = simulate_stage_costs(orders, [StageCosts(1.0, 2.0, 1.0, 2.5)] * 4, send_s=0.1)
    assert equal == simulate_stages(orders, 1.0, 2.0, send_s=0.1, weight_s=1.0, paired_s=2.5)
    with pytest.raises(ValueError, match="costs has 3 stages; the orders run 4"):
        simulate_stage_costs(orders, [StageCosts(1.0, 2.0)] * 3)
