"""The actions of a pipeline's schedule, timed where torch's runtime calls them, and the schedule's
step priced from them (``moeflow bench stages``' prediction).

Each of a rank's torch stages gets its ``forward_one_chunk``, ``backward_one_chunk`` (full, or
zero-bubble's input half) and ``backward_weight_one_chunk`` wrapped in a clock, on the instance:
the runtime's own calls are timed, receives and sends outside them. A backward that ran in the
overlap's second thread and the forward beside it make a pair, timed from the first start to the
last end. Per stage and kind the median is kept; the ranks' tables are combined by maximum (the
slowest of a stage's expert-parallel ranks, whose collectives the others wait for), and
:func:`moeflow.perf.stage_schedule.simulate_stage_costs` runs the schedule's orders on them. The
check is of the schedule's model (its order, its dependencies, its bubble), not of what an action
costs, which the calibrated simulator prices elsewhere.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moeflow.perf.stage_schedule import BACKWARD, FORWARD, INPUT, WEIGHT, StageCosts, simulate_stage_costs, stage_orders

PAIRED = "pair"
COLUMNS = (FORWARD, BACKWARD, INPUT, WEIGHT, PAIRED)
"""A stage's row in the combined table: the medians of each kind (0: none ran)."""


@dataclass(frozen=True)
class TimedAction:
    """One action of one stage, its start and end (``perf_counter``) and whether it ran in the
    overlap's second thread."""

    kind: str
    stage: int
    start: float
    end: float
    side: bool


@dataclass
class ActionClock:
    """The timed actions of a rank's stages while ``recording``."""

    actions: list[TimedAction] = field(default_factory=list)
    recording: bool = False

    def attach(self, torch_stages: list[Any]) -> None:
        """Wrap each stage's action methods on the instance (torch's runtime calls them there)."""
        for stage in torch_stages:
            index = stage.stage_index
            stage.forward_one_chunk = self._timed(lambda *a, **k: FORWARD, index, stage.forward_one_chunk)
            stage.backward_one_chunk = self._timed(_backward_kind, index, stage.backward_one_chunk)
            stage.backward_weight_one_chunk = self._timed(lambda *a, **k: WEIGHT, index,
                                                          stage.backward_weight_one_chunk)

    def _timed(self, kind_of: Callable[..., str], stage: int, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = call(*args, **kwargs)
            if self.recording:
                side = threading.current_thread() is not threading.main_thread()
                self.actions.append(TimedAction(kind_of(*args, **kwargs), stage, start, time.perf_counter(), side))
            return result
        return timed

    def table(self, num_stages: int) -> list[float]:
        """Each stage's medians of :data:`COLUMNS`, flat (stage-major), 0 where none ran here."""
        samples: dict[tuple[int, str], list[float]] = {}
        paired = self._pairs(samples)
        for action in self.actions:
            if action not in paired:
                samples.setdefault((action.stage, action.kind), []).append(action.end - action.start)
        return [statistics.median(samples[stage, kind]) if (stage, kind) in samples else 0.0
                for stage in range(num_stages) for kind in COLUMNS]

    def _pairs(self, samples: dict[tuple[int, str], list[float]]) -> set[TimedAction]:
        """The overlap's pairs (a second-thread backward and the forward it overlaps), timed into
        ``samples`` under the forward's stage; returns the actions they hold."""
        forwards = [action for action in self.actions if action.kind == FORWARD and not action.side]
        held: set[TimedAction] = set()
        for backward in (action for action in self.actions if action.side):
            forward = next(f for f in forwards if f.start <= backward.end and backward.start <= f.end)
            span = max(forward.end, backward.end) - min(forward.start, backward.start)
            samples.setdefault((forward.stage, PAIRED), []).append(span)
            held |= {forward, backward}
        return held


def _backward_kind(*args: Any, **kwargs: Any) -> str:
    """A full backward, or zero-bubble's input half (``full_backward=False``)."""
    full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
    return BACKWARD if full else INPUT


def stage_costs(table: list[float]) -> list[StageCosts]:
    """The combined table as each stage's costs: a backward not run whole is its input half plus
    its weight half; a pair never run is the two one after the other."""
    width = len(COLUMNS)
    costs = []
    for row in (table[start:start + width] for start in range(0, len(table), width)):
        forward_s, backward_s, input_s, weight_s, paired_s = row
        costs.append(StageCosts(forward_s, backward_s or input_s + weight_s, weight_s, paired_s or None))
    return costs


def predicted_step_s(schedule: str, pp_size: int, microbatches: int, table: list[float]) -> float:
    """The schedule's step on the measured stage costs (sends inside a node: not priced)."""
    return simulate_stage_costs(stage_orders(schedule, pp_size, microbatches), stage_costs(table)).step_s
