"""The persistent gloo workers behind the suite's distributed tests: a job runs as on fresh workers
(its own group, the caller's environment, the first seed) and fails as run_distributed fails."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from moeflow.distributed import WorkerError, run_distributed
from moeflow.testbed.worker_pool import WorkerPool

pytestmark = pytest.mark.distributed


def _state(rank: int, world_size: int, note: str) -> dict[str, object]:
    """What a job sees, then changes that must not reach the next job."""
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    seen = {"pid": os.getpid(), "sum": total.item(), "world": dist.get_world_size(), "note": os.environ.get("NOTE"),
            "draw": torch.rand(3).tolist(), "grad": torch.is_grad_enabled(), "threads": torch.get_num_threads(),
            "leaked": os.environ.get("LEAKED")}
    dist.new_group([0])  # a group of the job's own: destroyed with it
    os.environ["LEAKED"] = note
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.rand(5)
    return seen


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own error")
    dist.barrier()


def _exit_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _speak(rank: int, world_size: int, word: str) -> None:
    print(f"{word} from {rank}")
    os.write(2, f"{word} on fd 2 from {rank}\n".encode())  # what a library writes below Python


def test_each_jobs_output_reaches_the_callers_streams(capfd: pytest.CaptureFixture[str]) -> None:
    """A pool spawned during an earlier test holds that test's descriptors: the output is forwarded."""
    pool = WorkerPool(2)
    try:
        pool.run(_speak, "first")
        first = capfd.readouterr()
        pool.run(_speak, "second")
        second = capfd.readouterr()
    finally:
        pool.close()
    assert first.out == "first from 0\nfirst from 1\n" and first.err == "first on fd 2 from 0\nfirst on fd 2 from 1\n"
    assert second.out == "second from 0\nsecond from 1\n" and "first" not in second.err


def test_jobs_run_on_the_same_processes_each_as_on_fresh_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = WorkerPool(2)
    try:
        monkeypatch.setenv("NOTE", "first")
        first = pool.run(_state, "one")
        monkeypatch.setenv("NOTE", "second")  # set after the pool spawned: the job still sees it
        second = pool.run(_state, "two")
    finally:
        pool.close()
    fresh = run_distributed(_state, 2, "fresh")
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # no new interpreter
    for results, note in ((first, "first"), (second, "second"), (fresh, "second")):
        for seen in results:
            assert (seen["sum"], seen["world"], seen["note"]) == (3.0, 2, note)
            assert (seen["grad"], seen["threads"], seen["leaked"]) == (True, 1, None)
    assert [r["draw"] for r in second] == [r["draw"] for r in first]  # each job from the process's first seed


def test_a_failed_job_names_its_worker_and_the_next_job_gets_new_processes() -> None:
    pool = WorkerPool(2)
    try:
        before = [seen["pid"] for seen in pool.run(_state, "before")]
        with pytest.raises(WorkerError, match=r"(?s)worker 1 of 2 failed:.*rank one's own error"):
            pool.run(_raise_on_rank_one)
        with pytest.raises(WorkerError, match="worker 0 of 2 died with exit code 3"):
            pool.run(_exit_on_rank_zero)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"workers \[0, 1\] did not finish within 2 s"):
            pool.run(_sleep, 60.0, timeout_s=2)
        assert time.monotonic() - started < 20  # the hung job is stopped, not waited for
        after = [seen["pid"] for seen in pool.run(_state, "after")]
    finally:
        pool.close()
    assert not set(before) & set(after)


def test_a_job_that_does_not_pickle_fails_in_the_caller() -> None:
    pool = WorkerPool(1)
    try:
        with pytest.raises((AttributeError, TypeError, ValueError, pickle.PicklingError)):
            pool.run(lambda rank, world_size: rank)
        assert pool.run(_sleep, 0.0) == [None]
    finally:
        pool.close()


def _fsdp_norm(rank: int, world_size: int, groups_before: int) -> int:
    """FSDP2 on a mesh of a group of the job's own, then a sharded gradient's norm (as
    clip_grad_norm_ takes it), after ``groups_before`` other groups: DTensor caches plans that name
    the job's groups, by a mesh equality that ignores them."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    for _ in range(groups_before):
        dist.new_group()
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=DeviceMesh.from_group(dist.new_group(), "cpu"))
    model(torch.ones(2, 4)).sum().backward()
    norm = torch.linalg.vector_norm(model.weight.grad).full_tensor()
    assert norm.item() > 0
    return os.getpid()


def test_a_job_that_ran_dtensor_operations_leaves_new_processes_to_the_next() -> None:
    """Two such jobs in a row both run (before, the second found the first's mesh in DTensor's caches
    and failed with "Could not resolve the process group"); a plain job keeps its processes."""
    pool = WorkerPool(2)
    try:
        first = pool.run(_fsdp_norm, 2)
        second = pool.run(_fsdp_norm, 0)  # the same mesh, on a group of another name
        assert not set(first) & set(second)
        plain = [seen["pid"] for seen in pool.run(_state, "a")]
        assert plain == [seen["pid"] for seen in pool.run(_state, "b")]
    finally:
        pool.close()
