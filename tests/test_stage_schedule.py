"""The pipeline schedules' prices against their closed forms: GPipe's and 1F1B's step is
(M + P - 1)(F + B), Megatron's interleaved 1F1B's (v M + P - 1)(F + B) / v for stages of 1 / v of
a rank's blocks; a send between ranks adds to the critical path, never to a rank's busy time."""

from __future__ import annotations

import pytest

from moeflow.perf.stage_schedule import BACKWARD, FORWARD, simulate_stages, stage_orders


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
    with pytest.raises(ValueError, match="gpipe, 1f1b and interleaved"):
        stage_orders("dualpipev", 2, 4)
