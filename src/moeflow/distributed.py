"""Spawn gloo worker processes on this machine and collect what each returns.

Used by the tests, the benchmarks and the CLI. Fails fast and says which worker failed: a worker
that raises, dies or exceeds the deadline ends the whole run, every collective has a timeout, and
the surviving workers are terminated.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeflow.comm.ledger import process_state
from moeflow.comm.strict import strict_collectives
from moeflow.runtime import tune_cpu_allocator, tuning_requested


class WorkerError(RuntimeError):
    """A spawned worker raised, died or timed out."""


def destroy_process_groups() -> None:
    """Destroy the job's process groups once nothing holds them any more. A gloo group whose last
    reference (a model's groups, kept in a reference cycle) is only dropped during interpreter
    shutdown frees its pending work there and aborts the process ("terminate called without an
    active exception"), so the cycles are collected first, while the interpreter is whole."""
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
    results: Any, threads: int, collective_timeout_s: float, tune_allocator: bool = True, strict: bool = False,
) -> None:
    prepare_worker_process(tune_allocator)
    torch.set_num_threads(threads)
    gc.freeze()  # the imports' objects: the group's teardown collects twice, and need not pass over them
    run_in_group(rank, world_size, port, fn, args, results, collective_timeout_s, strict)


def prepare_worker_process(tune_allocator: bool = True) -> None:
    """What a gloo worker process sets once: the loopback interface, the allocator's tuning (unless
    ``MOEFLOW_MALLOC_TUNING=0``, or a caller that runs what a user's own process would)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tune_cpu_allocator(tune_allocator and tuning_requested(os.environ))


def run_in_group(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any,
    collective_timeout_s: float, strict: bool = False,
) -> None:
    """Join a new gloo group at ``port``, put ``(rank, ok, fn's value or the traceback)`` on
    ``results``, and destroy every group the call made. ``strict``: the job's collectives are
    checked as NCCL needs them (:mod:`moeflow.comm.strict`): one order per group on every rank."""
    try:
        timeout = timedelta(seconds=collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        checked = strict_collectives(rank, world_size, store, collective_timeout_s) if strict else nullcontext()
        with checked:
            value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            destroy_process_groups()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads_per_worker: int = 1,
    timeout_s: float = 600.0,
    collective_timeout_s: float = 60.0,
    tune_allocator: bool = True,
    strict: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank.
    ``tune_allocator=False`` leaves glibc's allocator as a user's own process has it (see
    :mod:`moeflow.runtime`). ``strict=True`` checks the job's collectives as NCCL needs them
    (:mod:`moeflow.comm.strict`).

    ``fn`` and ``args`` must be picklable (a module-level function). Raises :class:`WorkerError`
    naming the worker if any worker raises, dies, or the run exceeds ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    workers = [
        context.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, results, threads_per_worker, collective_timeout_s,
                  tune_allocator, strict),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    collected: dict[int, Any] = {}
    try:
        collect_results(workers, results, timeout_s, collected)
    finally:
        stop_workers(workers, wait_s=5 if len(collected) == world_size else 0.1)
    return [collected[rank] for rank in range(world_size)]


def collect_results(workers: list[Any], results: Any, timeout_s: float, collected: dict[int, Any]) -> None:
    """Fill ``collected`` with each worker's ``(rank, ok, value)`` from ``results``; raise
    :class:`WorkerError` naming the worker at the first that raised, died or ran past ``timeout_s``."""
    world_size = len(workers)
    deadline = time.monotonic() + timeout_s
    grace_polls = 0
    while len(collected) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = _first_dead(workers, collected)
            if dead is not None:
                grace_polls += 1  # its result may still be in the pipe: poll a little longer
                if grace_polls > 10:
                    raise WorkerError(
                        f"worker {dead} of {world_size} died with exit code {workers[dead].exitcode} before returning"
                    ) from None
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in collected]
                raise WorkerError(f"workers {missing} did not finish within {timeout_s:.0f} s") from None
            continue
        if not ok:
            raise WorkerError(_failure_message(workers, collected, rank, value))
        collected[rank] = value


def stop_workers(workers: list[Any], wait_s: float, grace_s: float = 3.0) -> None:
    """End every worker: those still running after ``wait_s`` get SIGTERM, then SIGCONT (a stopped
    process, by SIGSTOP or a debugger, only acts on the SIGTERM once continued), and those still
    there ``grace_s`` later SIGKILL."""
    for signal_them in (_terminate, lambda worker: worker.kill()):
        _join_within(workers, wait_s)
        for worker in workers:
            if worker.is_alive():
                signal_them(worker)
        wait_s = grace_s
    _join_within(workers, 5.0)


def _terminate(worker: Any) -> None:
    worker.terminate()
    with contextlib.suppress(ProcessLookupError):
        os.kill(worker.pid, signal.SIGCONT)


def _join_within(workers: list[Any], seconds: float) -> None:
    """Wait for the workers to end, ``seconds`` for all of them together."""
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))


def _failure_message(workers: list[Any], collected: dict[int, Any], rank: int, error: str) -> str:
    """Name the root cause: a peer that died usually makes the others fail in a collective."""
    message = f"worker {rank} of {len(workers)} failed:\n{error}"
    for other, worker in enumerate(workers):
        if other != rank and other not in collected and process_state(worker.pid) == "stopped":
            stopped = f"worker {other} of {len(workers)} is stopped (SIGSTOP, a debugger or a paused machine)"
            return f"{stopped}; then {message}"
    for other, worker in enumerate(workers):
        if other != rank and other not in collected:
            worker.join(timeout=1.0)
            if not worker.is_alive() and worker.exitcode not in (0, None):
                return (
                    f"worker {other} of {len(workers)} died with exit code {worker.exitcode}; "
                    f"then {message}"
                )
    return message


def _first_dead(workers: list[Any], collected: dict[int, Any]) -> int | None:
    for rank, worker in enumerate(workers):
        if rank not in collected and not worker.is_alive():
            return rank
    return None
