"""Expert-parallel setup errors and fail-fast behaviour of spawned gloo workers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from moeflow.distributed import WorkerError, run_distributed


def _build_indivisible(rank: int, world_size: int) -> None:
    from moeflow import MoELayer

    MoELayer(8, 8, num_experts=3)


TOPOLOGY_SETTINGS = {"alltoall": "2dh", "pipeline": "smart", "topology_gate": 0.5}
"""The settings that need the world group's node layout, each refused on a custom group."""


def _topology_settings_on_custom_group(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    from moeflow import MoELayer

    subgroup = dist.new_group([0, 1])
    messages = []
    for name, value in TOPOLOGY_SETTINGS.items():
        try:
            MoELayer(8, 8, num_experts=2, group=subgroup, **{name: value})
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def _die(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)  # a killed worker: no exception, no result
    dist.all_reduce(torch.ones(1))  # rank 0 waits for the dead one until the collective timeout


def _stop(rank: int, world_size: int, pid_file: str) -> None:
    import signal

    import torch
    import torch.distributed as dist

    if rank == 1:
        with open(pid_file, "w") as file:
            file.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # a stuck worker: alive, never answering
    dist.all_reduce(torch.ones(1))  # rank 0 waits for the stopped one until the collective timeout


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return rank


def _echo_rank(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


@pytest.mark.distributed
def test_experts_not_divisible_by_workers_is_a_clear_error() -> None:
    expected = r"num_experts=3 is not divisible by the expert group size 2.*parallel='replicated'"
    with pytest.raises(WorkerError, match=expected):
        run_distributed(_build_indivisible, 2, timeout_s=120)


@pytest.mark.distributed
def test_topology_aware_settings_refuse_a_custom_group() -> None:
    """Where the expert group is not the world group, every setting that needs the node layout
    refuses when the layer is built, naming itself (none silently does nothing)."""
    for messages in run_distributed(_topology_settings_on_custom_group, 2, timeout_s=120):
        assert "use alltoall='linear' with a custom group" in messages[0]
        assert "pipeline='auto'" in messages[1] and "custom group" in messages[1]
        assert "topology_gate='off'" in messages[2] and "custom group" in messages[2]


@pytest.mark.distributed
def test_a_dead_worker_fails_the_run_fast_and_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match="worker 1 of 2 died with exit code 3"):
        run_distributed(_die, 2, timeout_s=120, collective_timeout_s=30)
    assert time.monotonic() - start < 60


@pytest.mark.distributed
def test_a_stopped_worker_ends_the_run_within_the_timeout_and_is_named(tmp_path: Path) -> None:
    pid_file = tmp_path / "stopped.pid"
    with pytest.raises(WorkerError, match="worker 1 of 2 is stopped"):
        run_distributed(_stop, 2, str(pid_file), timeout_s=120, collective_timeout_s=5)
    assert time.time() - pid_file.stat().st_mtime < 5 + 10  # from the stop: the timeout and 10 s at most
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left behind
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.distributed
def test_a_raising_worker_reports_its_traceback() -> None:
    with pytest.raises(WorkerError, match=r"(?s)worker 1 of 2 failed.*boom on purpose"):
        run_distributed(_raise_on_rank_one, 2, timeout_s=120)


@pytest.mark.distributed
def test_results_come_back_by_rank() -> None:
    assert run_distributed(_echo_rank, 3, timeout_s=120) == [(0, 3), (1, 3), (2, 3)]
