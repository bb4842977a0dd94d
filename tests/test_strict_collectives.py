"""The strict mode (moeflow.comm.strict) catches what NCCL would hang on and gloo forgives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow.comm.strict import first_divergence
from moeflow.distributed import WorkerError
from pool import run_distributed

pytestmark = pytest.mark.distributed


def _agreeing(rank: int, world_size: int) -> int:
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    pair = dist.new_group([0, 1])
    dist.all_gather_object([None] * world_size, rank)
    dist.all_to_all_single(torch.empty(3), torch.ones(2 * rank + 2), [1, 2], [rank + 1] * 2)  # ragged: sizes differ
    dist.all_reduce(torch.ones(3, dtype=torch.int64), group=pair)
    return int(tensor[0])


def test_agreeing_collectives_pass() -> None:
    assert run_distributed(_agreeing, 2) == [2, 2]


def _swapped(rank: int, world_size: int) -> None:
    first, second = torch.ones(4), torch.ones(4, dtype=torch.int32)  # same bytes: gloo mixes them silently
    for tensor in (first, second) if rank == 0 else (second, first):
        dist.all_reduce(tensor)


def test_two_all_reduces_swapped_on_one_rank_fail_the_job() -> None:
    with pytest.raises(WorkerError, match=r"collective order differs on group 0 \(ranks 0,1\) at its collective #1: "
                                          r"worker 0 issued all_reduce of float32 x 4 while worker 1 issued "
                                          r"all_reduce of int32 x 4"):
        run_distributed(_swapped, 2)


def _skipped(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(4))  # skipped on rank 1: a statistics all-reduce taken on one rank only
    dist.all_reduce(torch.ones(4))


def test_a_collective_skipped_on_one_rank_is_named() -> None:
    with pytest.raises(WorkerError, match=r"at its collective #2: worker 0 issued all_reduce of float32 x 4 "
                                          r"while worker 1 issued nothing"):
        run_distributed(_skipped, 2, collective_timeout_s=3.0)


def _lazy_group(rank: int, world_size: int) -> None:
    if rank < 2:  # made on first use by its members alone: ncclCommSplit needs every rank
        group = dist.new_group([0, 1], use_local_synchronization=True)
        dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()


def test_a_group_made_by_its_members_alone_fails_the_job() -> None:
    with pytest.raises(WorkerError, match=r"worker 0 issued new_group\(ranks 0,1, local\) while worker 2 issued "
                                          r"barrier"):
        run_distributed(_lazy_group, 4)


def _fake_nccl(store: dist.Store, rank: int, size: int, timeout: object) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _cpu_into_cuda_group(rank: int, world_size: int) -> None:
    if "fakenccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("fakenccl", _fake_nccl, devices=["cuda"])
    group = dist.new_group([0, 1], backend="fakenccl")  # declared for CUDA tensors only, as NCCL is
    dist.all_reduce(torch.ones(2), group=group)


def test_a_cpu_tensor_into_a_cuda_only_group_is_refused() -> None:
    with pytest.raises(WorkerError, match=r"all_reduce of a cpu tensor on group .* whose backend 'fakenccl' serves "
                                          r"cuda only"):
        run_distributed(_cpu_into_cuda_group, 2)


def test_first_divergence_names_a_peer_without_a_record() -> None:
    records = {0: {"sequences": {"g": [["all_reduce", "float32", 4]]}, "members": {"g": [0, 1]}}}
    assert "worker(s) [1] left no record" in first_divergence(records)
    agreeing = {rank: {"sequences": {"g": [["barrier", "", -1]]}, "members": {"g": [0, 1]}} for rank in (0, 1)}
    assert first_divergence(agreeing) is None


def test_a_rank_whose_job_failed_stopping_early_is_no_divergence() -> None:
    """Its own error says why it stopped; a rank that ended well but issued less is named."""
    longer = {"sequences": {"g": [["barrier", "", -1], ["barrier", "", -1]]}, "members": {"g": [0, 1]}}
    shorter = {"sequences": {"g": [["barrier", "", -1]]}, "members": {"g": [0, 1]}}
    assert first_divergence({0: longer, 1: {**shorter, "failed": True}}) is None
    assert "worker 1 issued nothing" in first_divergence({0: {**longer, "failed": True}, 1: shorter})
