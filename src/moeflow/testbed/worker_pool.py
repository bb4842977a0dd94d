"""Gloo worker processes kept for many short jobs: each world size spawns once.

Spawning a worker starts an interpreter that imports torch and moeflow, seconds on a small machine;
a test suite that ran a hundred distributed jobs paid it a hundred times. A :class:`WorkerPool`
spawns its processes once and sends them jobs. Each job still starts as a fresh worker would:

- a new process group, joined at a port of its own and destroyed after the job, every group the
  job made with it;
- the caller's environment and working directory at the time of the call;
- torch's first seed, grad mode on, the default dtype fp32, the pool's intra-op thread count;
- its output: what each rank writes to its stdout and stderr (file descriptors 1 and 2) during the
  job is written to the caller's ``sys.stdout`` and ``sys.stderr`` when the job ends, rank by rank
  (a spawned process would write to the descriptors it inherited, which a pool spawned earlier
  holds from then).

A job that ran DTensor operations ends its processes after it (:func:`_kept_device_meshes`): torch
caches what such a job planned in ways a later job cannot undo.

It fails as :func:`~moeflow.distributed.run_distributed` does. A job that raises, dies or runs past
its deadline raises :class:`~moeflow.distributed.WorkerError` naming the worker. The pool's
processes end with it, and the next job spawns new ones.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from moeflow.distributed import collect_results, free_port, prepare_worker_process, run_in_group, stop_workers


class WorkerPool:
    """``world_size`` gloo processes, one intra-op thread each unless told otherwise, that run
    one job at a time (:meth:`run`) until :meth:`close`; ``strict``: each job's collectives are
    checked across ranks (:mod:`moeflow.comm.strict`)."""

    def __init__(self, world_size: int, threads_per_worker: int = 1, strict: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.threads_per_worker = world_size, threads_per_worker
        self.strict = strict  # every job's collectives checked as NCCL needs them (moeflow.comm.strict)
        self._workers: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._output: Path | None = None  # each rank's stdout and stderr of the current job

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, collective_timeout_s: float = 60.0,
    ) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every worker; the results by rank (as
        :func:`~moeflow.distributed.run_distributed`, whose arguments these are)."""
        job = bytes(ForkingPickler.dumps((fn, args)))  # here, so a value that does not pickle fails in the caller
        if not self._workers or not all(worker.is_alive() for worker in self._workers):
            self._start()
        port, environment = free_port(), dict(os.environ)
        for tasks in self._tasks:
            tasks.put((port, job, collective_timeout_s, environment, os.getcwd(), self.strict))
        collected: dict[int, Any] = {}
        try:
            collect_results(self._workers, self._results, timeout_s, collected)
        except BaseException:
            self._forward_output()
            self.close(wait_s=0.1)  # a failed job leaves its processes in an unknown state
            raise
        self._forward_output()
        assert self._output is not None
        if any((self._output / f"{rank}{RETIRED}").exists() for rank in range(self.world_size)):
            self.close()  # the next job spawns new processes
        return [collected[rank] for rank in range(self.world_size)]

    def _forward_output(self) -> None:
        """Write what the job's ranks wrote to this process's streams, rank by rank."""
        assert self._output is not None
        for rank in range(self.world_size):
            for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
                path = self._output / f"{rank}.{name}"
                if path.exists() and path.stat().st_size:
                    stream.write(path.read_text(errors="replace"))
                    stream.flush()
                    path.write_bytes(b"")

    def stop_soon(self) -> None:
        """Tell the processes to end once idle, without waiting for them (:meth:`close` waits):
        several pools end together."""
        for tasks in self._tasks:
            tasks.put(None)

    def close(self, wait_s: float = 5.0) -> None:
        """End the processes (a job that is still running is stopped)."""
        self.stop_soon()
        stop_workers(self._workers, wait_s=wait_s)
        if self._output is not None:
            shutil.rmtree(self._output, ignore_errors=True)
        self._workers, self._tasks, self._results, self._output = [], [], None, None

    def _start(self) -> None:
        self.close(wait_s=0.1)
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._output = Path(tempfile.mkdtemp(prefix="moeflow-pool-"))
        self._workers = [
            context.Process(target=_serve, args=(rank, self.world_size, tasks, self._results, self.threads_per_worker,
                                                 str(self._output)), daemon=True)
            for rank, tasks in enumerate(self._tasks)
        ]
        for worker in self._workers:
            worker.start()


def _serve(rank: int, world_size: int, tasks: Any, results: Any, threads: int, output: str) -> None:
    """A pool process: run jobs until told to stop, each from a fresh worker's state (set per job)."""
    first_seed = torch.initial_seed()
    gc.freeze()  # the imports' objects: see below
    while (task := tasks.get()) is not None:
        port, job, collective_timeout_s, environment, cwd, strict = task
        _fresh_state(environment, cwd, threads, first_seed)
        with _written_to(Path(output) / f"{rank}.out", Path(output) / f"{rank}.err"):
            run_in_group(rank, world_size, port, _call, (job, output), results, collective_timeout_s, strict)
        gc.collect()
        # What outlived the job (modules it imported, their caches) is set aside from the collector:
        # each job's group teardown collects three times, and a full pass over torch's objects took
        # 0.25 s a time per rank, more than many jobs' own work.
        gc.freeze()
        if (Path(output) / f"{rank}{RETIRED}").exists():
            return


def _call(rank: int, world_size: int, job: bytes, output: str) -> Any:
    """Unpickled inside the group's try, so a job that does not load reports its traceback. The
    streams are flushed, and a worker that cannot serve another job says so, before the result is
    sent: the caller reads both once it has every result."""
    try:
        fn, args = pickle.loads(job)
        return fn(rank, world_size, *args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if _kept_device_meshes():
            (Path(output) / f"{rank}{RETIRED}").touch()


RETIRED = ".retired"
"""The file a worker writes beside its output when it ends after the job (see :func:`_kept_device_meshes`)."""


def _kept_device_meshes() -> bool:
    """Whether the job ran DTensor operations. DTensor caches its sharding and redistribution plans
    by DeviceMesh equality, which ignores the mesh's process groups, and some of those caches are
    per thread: a later job's equal mesh would get back plans that name this job's destroyed
    groups ("Could not resolve the process group"). Such a worker ends after the job, and the next
    job gets new processes, as a new worker has no such cache."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagate = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    cache = getattr(getattr(propagate, "propagate_op_sharding", None), "cache", None)
    used = cache is not None and cache.cache_info().currsize > 0
    transforms = getattr(_redistribute, "_gen_transform_infos", None)
    planned = transforms is not None and transforms.cache_info().currsize > 0
    return used or planned or bool(getattr(_redistribute, "_planner_cache", None))


@contextlib.contextmanager
def _written_to(stdout: Path, stderr: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (Python's prints and a library's own writes alike) into these files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with stdout.open("ab") as out, stderr.open("ab") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)


def _fresh_state(environment: dict[str, str], cwd: str, threads: int, first_seed: int) -> None:
    """What a job may have changed in the process, as a newly spawned worker has it."""
    os.environ.clear()
    os.environ.update(environment)
    prepare_worker_process()
    os.chdir(cwd)
    torch.set_num_threads(threads)
    torch.manual_seed(first_seed)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
