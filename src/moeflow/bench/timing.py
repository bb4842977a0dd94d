"""Timing shared by the benchmarks: medians of round-robin runs, so noise hits every variant alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from moeflow.comm.groups import max_over_ranks

K = TypeVar("K", bound=Hashable)


def interleaved_medians(
    fns: dict[K, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    before_each: Callable[[], None] | None = None,
) -> dict[K, float]:
    """Median seconds of each function, measured round-robin after ``warmup`` untimed rounds.

    ``before_each`` (for example a barrier across workers) runs untimed before every sample.
    """
    samples: dict[K, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + repeats):
        for name, fn in fns.items():
            if before_each is not None:
                before_each()
            start = time.perf_counter()
            fn()
            if round_index >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def device_medians(
    fns: dict[K, Callable[[], object]], device: torch.device, repeats: int, warmup: int = 1,
    before_each: Callable[[], None] | None = None,
) -> dict[K, float]:
    """:func:`interleaved_medians` of work on ``device``: on CUDA each sample starts with the
    device idle and ends when it is done, not when the launches return."""
    if device.type != "cuda":
        return interleaved_medians(fns, repeats, warmup, before_each)

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            torch.cuda.synchronize(device)
        return run

    def before() -> None:
        if before_each is not None:
            before_each()
        torch.cuda.synchronize(device)

    return interleaved_medians({name: synced(fn) for name, fn in fns.items()}, repeats, warmup, before)


def slowest_rank_seconds(fn: Callable[[], object], group: dist.ProcessGroup | None = None) -> float:
    """One synchronized run of ``fn`` on every rank; the slowest rank's time (what all wait for).
    ``group=None``: the world group."""
    group = group or dist.group.WORLD
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    (elapsed,) = max_over_ranks([time.perf_counter() - start], group)
    return elapsed


def slowest_rank_medians(
    fns: dict[K, Callable[[], object]], repeats: int, warmup: int = 1, group: dist.ProcessGroup | None = None,
) -> dict[K, float]:
    """Median over ``repeats`` round-robin rounds of each function's :func:`slowest_rank_seconds`:
    every rank runs it at once, as inside a layer whose ranks meet at each all-to-all (on a shared
    CPU the ranks then contend for cores and memory, and the layer waits for the slowest)."""
    samples: dict[K, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + repeats):
        for name, fn in fns.items():
            seconds = slowest_rank_seconds(fn, group)
            if round_index >= warmup:
                samples[name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}


class SpeedProbe:
    """The reference expert FFN of :data:`~moeflow.perf.profile.SPEED_PROBE`, timed on every rank
    at once in each round of a benchmark: its median says how fast the machine ran during the
    measurement, so that a calibrated twin can be re-timed to it. Every rank calls :meth:`sample`."""

    def __init__(self) -> None:
        import torch

        from moeflow.experts import ExpertFFN
        from moeflow.perf.profile import SPEED_PROBE

        self._ffn = ExpertFFN(1, SPEED_PROBE["model_dim"], SPEED_PROBE["hidden_dim"])
        self._x = torch.randn(1, SPEED_PROBE["tokens"], SPEED_PROBE["model_dim"], requires_grad=True)
        self.samples: list[float] = []

    def _run(self) -> None:
        self._ffn(self._x).sum().backward()  # as ``moeflow calibrate`` times the FFN

    def sample(self) -> None:
        self.samples.append(slowest_rank_seconds(self._run))

    def record(self, bench: str, config: str) -> dict[str, Any]:
        return {"bench": "speed-probe", "measured_by": bench, "config": config,
                "probe_ms": statistics.median(self.samples) * 1e3}


def layer_training_step(layer: Any, x: Any) -> None:
    """One forward + backward of a layer (its output's mean square plus its aux loss), grads dropped."""
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    layer.zero_grad(set_to_none=True)


def settle_planner(layer: Any, x: Any, limit: int = 300) -> int:
    """Run training steps until the layer's planner serves from its dictionary (or has nothing to
    plan); the iterations it took."""
    for iteration in range(1, limit + 1):
        layer_training_step(layer, x)
        if layer.last_stats.plan.source in ("dictionary", "forced", "local"):
            return iteration
    return limit
