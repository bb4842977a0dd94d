"""Ranks that share a machine's cores (a CPU cluster, the emulated one): when a skewed load leaves
some ranks idle, the busy ones get the freed cores, so the hot rank's experts run faster than the
rate calibrated with every rank busy.

The model is processor sharing: ``cores`` cores serve the ``ranks`` ranks of one machine, each rank
at most one core (one intra-op thread), every rank of the machine starting the operation together
(its experts, right after the exchange that brought their rows)."""

from __future__ import annotations

import numpy as np


def shared_core_seconds(seconds: np.ndarray, cores: int, ranks_per_machine: int) -> np.ndarray:
    """Each rank's time for work that takes ``seconds`` when every rank of its machine is busy
    (the calibrated rate, ``cores / ranks_per_machine`` of a core each), with the cores of ranks
    that finish passed to those still working. Equal work keeps equal times."""
    times = np.asarray(seconds, dtype=np.float64)
    if cores <= 0 or cores >= ranks_per_machine or times.ndim == 0 or len(times) % ranks_per_machine:
        return times
    share = cores / ranks_per_machine
    out = np.empty_like(times)
    for start in range(0, len(times), ranks_per_machine):
        out[start:start + ranks_per_machine] = _processor_sharing(times[start:start + ranks_per_machine] * share,
                                                                  cores)
    return out


def _processor_sharing(core_seconds: np.ndarray, cores: int) -> np.ndarray:
    """Finish times of jobs of ``core_seconds`` (each at most one core) started together on ``cores``."""
    finish = np.empty_like(core_seconds)
    now = done = 0.0
    order = np.argsort(core_seconds, kind="stable")
    for position, job in enumerate(order):
        running = len(order) - position
        now += (core_seconds[job] - done) / min(1.0, cores / running)
        done = float(core_seconds[job])
        finish[job] = now
    return finish
