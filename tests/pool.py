"""The suite's distributed runs: ``run_distributed`` as the library's, on persistent gloo workers.

One :class:`~moeflow.testbed.worker_pool.WorkerPool` per world size and thread count serves every test of a
run, so a test pays a new process group, not a new interpreter. The tests of
:func:`moeflow.distributed.run_distributed` itself (tests/test_distributed.py) and those that
measure a whole process (its peak memory, its signals) call the library's directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moeflow.testbed.worker_pool import WorkerPool

_POOLS: dict[tuple[int, int], WorkerPool] = {}  # this test run's pools, closed by conftest at the end


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, threads_per_worker: int = 1, timeout_s: float = 600.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """:func:`moeflow.distributed.run_distributed`'s contract on this run's pool of ``world_size``."""
    key = (world_size, threads_per_worker)
    if key not in _POOLS:
        _POOLS[key] = WorkerPool(world_size, threads_per_worker, strict=True)  # NCCL's rules, on gloo
    return _POOLS[key].run(fn, *args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s)


def close_pools() -> None:
    """End every pool, all told at once; one still exiting after a second is terminated (an idle
    worker has nothing to lose, and a torch process's orderly exit took seconds)."""
    for pool in _POOLS.values():
        pool.stop_soon()
    for pool in _POOLS.values():
        pool.close(wait_s=1.0)
    _POOLS.clear()
