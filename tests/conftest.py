"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels run on CPU tensors only under its interpreter, which is chosen when a kernel
    # is defined: set before any test imports them (spawned gloo workers inherit it).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def worker_pools() -> Iterator[None]:
    """End the distributed tests' persistent gloo workers (tests/pool.py) with the run."""
    yield
    from pool import close_pools

    close_pools()


@pytest.fixture(autouse=True)
def pooled_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's own spawns (training, generation, benchmarks run in the test's process) go to
    the persistent workers too, unless the test is marked ``fresh_workers``: it measures the whole
    process (its peak memory, the children it leaves behind), so the pools end before it and its
    workers are spawned fresh. A ``moeflow`` subprocess and tests/test_distributed.py still spawn.
    Either way every job's collectives are checked as NCCL needs them (``strict``,
    :mod:`moeflow.comm.strict`)."""
    import functools

    import moeflow.distributed
    from pool import close_pools, run_distributed

    if request.node.get_closest_marker("fresh_workers") is not None:
        close_pools()
        strict = functools.partial(moeflow.distributed.run_distributed, strict=True)
        monkeypatch.setattr(moeflow.distributed, "run_distributed", strict)
        return
    monkeypatch.setattr(moeflow.distributed, "run_distributed", run_distributed)


@pytest.fixture(scope="session", autouse=True)
def corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the tokenized corpora of the tests out of the user's cache (spawned workers inherit it)."""
    cache = tmp_path_factory.mktemp("moeflow-cache")
    previous = os.environ.get("MOEFLOW_CACHE")
    os.environ["MOEFLOW_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("MOEFLOW_CACHE", None)
    else:
        os.environ["MOEFLOW_CACHE"] = previous
