"""How moeflow times work, in calibration and in the benchmarks: medians of round-robin runs, so
noise hits every variant alike, and the slowest rank of a synchronized run (what all ranks wait for).
Work on a CUDA device is timed by CUDA events (:mod:`moeflow.comm.clock`), work on the CPU by the
host clock."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.distributed as dist

from moeflow.comm.clock import start_span
from moeflow.comm.collectives import barrier
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
    return device_medians(fns, None, repeats, warmup, before_each)


def sample_seconds(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """One run of ``fn``'s seconds: the host clock (CPU, or ``device=None``); on CUDA the device
    is left idle first, and CUDA events on the current stream around the work give its time once
    it is done (the host clock would give the time to queue it)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    span = start_span(device)
    fn()
    span.stop()
    return span.seconds()


def device_medians(
    fns: dict[K, Callable[[], object]], device: torch.device | None, repeats: int, warmup: int = 1,
    before_each: Callable[[], None] | None = None,
) -> dict[K, float]:
    """:func:`interleaved_medians` of work on ``device``: each sample is :func:`sample_seconds`
    (on CUDA: CUDA events, the device idle at the start and the work done at the end)."""
    samples: dict[K, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + repeats):
        for name, fn in fns.items():
            if before_each is not None:
                before_each()
            seconds = sample_seconds(fn, device)
            if round_index >= warmup:
                samples[name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}


def slowest_rank_seconds(
    fn: Callable[[], object], group: dist.ProcessGroup | None = None, device: torch.device | None = None,
) -> float:
    """One synchronized run of ``fn`` on every rank; the slowest rank's time (what all wait for).
    ``group=None``: the world group. ``device``: where the work runs (:func:`sample_seconds`)."""
    group = group or dist.group.WORLD
    barrier(group)
    (elapsed,) = max_over_ranks([sample_seconds(fn, device)], group)
    return elapsed


def slowest_rank_medians(
    fns: dict[K, Callable[[], object]], repeats: int, warmup: int = 1, group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[K, float]:
    """Median over ``repeats`` round-robin rounds of each function's :func:`slowest_rank_seconds`:
    every rank runs it at once, as inside a layer whose ranks meet at each all-to-all (on a shared
    CPU the ranks then contend for cores and memory, and the layer waits for the slowest)."""
    samples: dict[K, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + repeats):
        for name, fn in fns.items():
            seconds = slowest_rank_seconds(fn, group, device)
            if round_index >= warmup:
                samples[name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}
