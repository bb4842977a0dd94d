"""How moeflow times work, in calibration and in the benchmarks: medians of round-robin runs, so
noise hits every variant alike, and the slowest rank of a synchronized run (what all ranks wait for)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

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
