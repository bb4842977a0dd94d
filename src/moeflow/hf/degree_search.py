"""``pipeline="auto"`` in the transformers backend: each block picks its chunk degree per batch size.

Tutel 3.3's dictionary search (the layer's ``pipeline="search"``, :mod:`moeflow.parallel.online_planner`),
without a cost model: the backend sees only the routed rows, not the layer's shapes a profile prices.
A block's calls are keyed by the group's rows (by power of two) and the largest degree every rank's
batch can fill (:data:`~moeflow.hf.expert_parallel.PIPELINE_MIN_ROWS` rows a chunk); on a new key each
candidate degree runs :data:`WARMUP` + :data:`TRIALS` calls, round robin, each call's time the slowest
rank's (one all-reduce; the warm-up's time is dropped), and the key keeps the fewest chunks within
:data:`~moeflow.perf.schedule_models.MIN_GAIN` of the fastest median. Every rank makes the same
choice: the key comes from the agreed row matrix, the times from the same all-reduce. No torch here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from moeflow.perf.schedule_models import MIN_GAIN

CANDIDATES = (1, 2, 4)
"""The chunk degrees ``auto`` tries (those every rank's batch fills)."""
WARMUP = 1
"""Calls of a degree whose time is dropped before its trials: the first at a new size grows buffers."""
TRIALS = 2
"""Timed calls of each candidate degree per key."""
SETTLE_CALLS = len(CANDIDATES) * (WARMUP + TRIALS)
"""The calls of one key after which every block has chosen its degree for it."""

Key = tuple[int, int]
"""(the group's rows as a power of two, the largest degree every rank's batch fills)."""


@dataclass
class DegreeSearch:
    """One block's choices, the samples of the keys still searched, the degree each key's last forward
    ran and the graphs of each key a backward has yet to reach. While a graph awaits its backward, the
    key's forwards run the degree it ran (untimed), so that activation checkpointing's recompute of any
    of them (:meth:`as_ran`) runs the degree its forward ran; a graph never taken backward keeps the
    key's search where it is."""

    chosen: dict[Key, int] = field(default_factory=dict)
    samples: dict[Key, dict[int, list[float]]] = field(default_factory=dict)
    ran: dict[Key, int] = field(default_factory=dict)
    awaiting: dict[Key, int] = field(default_factory=dict)

    @staticmethod
    def key(group_rows: int, largest: int) -> Key:
        return group_rows.bit_length(), largest

    def next(self, key: Key) -> tuple[int, bool]:
        """The degree to run this forward with, and whether to time it (then :meth:`record` its time)."""
        degree, timed = (self.ran[key], False) if self.awaiting.get(key, 0) else self._searched(key)
        self.ran[key] = degree
        return degree, timed

    def as_ran(self, key: Key) -> int:
        """The degree a recompute of this key's forward runs: the one it ran."""
        return self.ran.get(key, 1)

    def built(self, key: Key) -> None:
        """A forward of this key built a graph that a backward will reach."""
        self.awaiting[key] = self.awaiting.get(key, 0) + 1

    def reached(self, key: Key) -> None:
        """A backward reached a graph of this key."""
        self.awaiting[key] -= 1

    def _searched(self, key: Key) -> tuple[int, bool]:
        if key in self.chosen:
            return self.chosen[key], False
        candidates = [d for d in CANDIDATES if d <= key[1]]
        if len(candidates) == 1:
            self.chosen[key] = candidates[0]
            return candidates[0], False
        runs = self.samples.setdefault(key, {d: [] for d in candidates})
        degree = min(candidates, key=lambda d: len(runs[d]))  # round robin, the fewest chunks first
        return degree, True

    def record(self, key: Key, degree: int, seconds: float) -> None:
        """A timed call's slowest-rank seconds; the key's choice once every candidate has its trials."""
        runs = self.samples[key]
        runs[degree].append(seconds)
        if all(len(times) >= WARMUP + TRIALS for times in runs.values()):
            medians = {d: statistics.median(times[WARMUP:]) for d, times in runs.items()}
            fastest = min(medians.values())
            self.chosen[key] = min(d for d, m in medians.items() if m <= fastest * (1 + MIN_GAIN))
            del self.samples[key]
