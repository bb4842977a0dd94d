"""``moeflow bench stages``' clock: the runtime's calls timed per stage and kind, the overlap's pairs
found from their threads, and the schedule's step priced from the combined table."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from moeflow.bench.stage_clock import COLUMNS, ActionClock, TimedAction, predicted_step_s, stage_costs
from moeflow.perf.stage_schedule import BACKWARD, FORWARD, INPUT, WEIGHT, StageCosts, simulate_stages, stage_orders


def _stage(index: int, calls: list[tuple[Any, ...]]) -> SimpleNamespace:
    return SimpleNamespace(
        stage_index=index,
        forward_one_chunk=lambda *a, **k: calls.append(("F", index, a, k)) or "out",
        backward_one_chunk=lambda *a, **k: calls.append(("B", index, a, k)),
        backward_weight_one_chunk=lambda *a, **k: calls.append(("W", index, a, k)))


def test_the_clock_times_the_runtimes_calls_by_kind_and_passes_them_through() -> None:
    calls: list[tuple[Any, ...]] = []
    stages = [_stage(0, calls), _stage(3, calls)]
    clock = ActionClock()
    clock.attach(stages)
    assert stages[0].forward_one_chunk(0, ("x",), {}) == "out"  # not recording: passed through, untimed
    clock.recording = True
    stages[0].forward_one_chunk(1, ("x",), {})
    stages[1].backward_one_chunk(1, loss=None, full_backward=False, last_backward=False)
    stages[1].backward_one_chunk(2, None, True)
    stages[1].backward_weight_one_chunk(1, last_backward=True)
    assert [(c[0], c[1]) for c in calls] == [("F", 0), ("F", 0), ("B", 3), ("B", 3), ("W", 3)]
    assert calls[2][3] == {"loss": None, "full_backward": False, "last_backward": False}
    assert [(a.kind, a.stage, a.side) for a in clock.actions] == [
        (FORWARD, 0, False), (INPUT, 3, False), (BACKWARD, 3, False), (WEIGHT, 3, False)]
    thread = threading.Thread(target=lambda: stages[1].backward_one_chunk(3))
    thread.start()
    thread.join()
    assert clock.actions[-1].side


def test_a_side_thread_backward_pairs_with_the_forward_it_overlaps() -> None:
    clock = ActionClock([TimedAction(FORWARD, 0, 0.0, 1.0, False), TimedAction(FORWARD, 0, 2.0, 3.0, False),
                         TimedAction(BACKWARD, 3, 2.5, 4.5, True), TimedAction(BACKWARD, 3, 5.0, 7.0, False),
                         TimedAction(INPUT, 0, 7.0, 8.5, False), TimedAction(WEIGHT, 0, 8.5, 9.0, False)])
    table = clock.table(4)
    rows = {stage: dict(zip(COLUMNS, table[stage * 5:(stage + 1) * 5], strict=True)) for stage in range(4)}
    assert rows[0] == {"F": 1.0, "B": 0.0, "I": 1.5, "W": 0.5, "pair": 2.5}  # the pair: 2.0 .. 4.5
    assert rows[3] == {"F": 0.0, "B": 2.0, "I": 0.0, "W": 0.0, "pair": 0.0}  # the paired backward is not a B
    assert rows[1] == rows[2] == dict.fromkeys(COLUMNS, 0.0)
    assert stage_costs(table)[0] == StageCosts(1.0, 2.0, 0.5, 2.5)  # no whole backward: I + W
    assert stage_costs(table)[3] == StageCosts(0.0, 2.0, 0.0, None)


def test_the_prediction_runs_the_schedules_orders_on_the_table() -> None:
    table = [1.0, 2.0, 0.0, 1.0, 2.5] * 4
    assert predicted_step_s("dualpipev", 2, 8, table) == pytest.approx(
        simulate_stages(stage_orders("dualpipev", 2, 8), 1.0, 2.0, weight_s=1.0, paired_s=2.5).step_s)
