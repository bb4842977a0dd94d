"""Gradient synchronization during the backward (``--grad-sync overlap|lina``): the same gradients as
one all-reduce after the backward on 2 and 4 workers and every pipeline degree, every piece reduced
exactly once, and Lina's scheduler holding its micro-ops while an all-to-all is imminent."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from moeflow.comm.traffic import AllToAllTraffic, TimelineEvent, contention_seconds
from moeflow.models import MoETransformer, TransformerConfig
from moeflow.training.grad_sync import buckets, gradient_scheduler, micro_ops
from moeflow.training.gradients import replicated_parameters, synchronize_gradients
from pool import run_distributed

MODES = ("after", "overlap", "lina")
DEGREES = (1, 2, 4)
MICROOP_MB = 0.001  # ~1 KB: every gradient in several micro-ops
BUCKET_MB = 0.004


def _covered(pieces: list[Any], sizes: list[int]) -> list[np.ndarray]:
    seen = [np.zeros(size, dtype=int) for size in sizes]
    for piece in pieces:
        for index, start, stop in piece.spans:
            seen[index][start:stop] += 1
    return seen


def test_micro_ops_are_equal_parts_of_one_gradient_and_cover_each_element_once() -> None:
    sizes = [1000, 7, 100, 200, 4096, 1, 3]
    pieces = micro_ops(sizes, element_bytes=4, microop_bytes=1024)  # 256 elements per micro-op
    assert [sum(1 for p in pieces if p.parameters == (i,)) for i in (0, 4)] == [4, 16]
    assert {p.numel for p in pieces if p.parameters == (0,)} == {250}
    # small gradients fused, whole, up to a micro-op's size; never beside a part of a large one
    assert [p.parameters for p in pieces if len(p.parameters) > 1 or p.parameters[0] not in (0, 4)] == [
        (1, 2), (3,), (5, 6)]
    assert all(p.numel <= 256 for p in pieces)
    assert all((count == 1).all() for count in _covered(pieces, sizes))


def test_buckets_fuse_whole_gradients_in_order_until_full() -> None:
    sizes = [100, 100, 300, 10, 10]
    pieces = buckets(sizes, element_bytes=4, bucket_bytes=800)  # closes at 200 elements
    assert [piece.parameters for piece in pieces] == [(0, 1), (2,), (3, 4)]
    assert all((count == 1).all() for count in _covered(pieces, sizes))


def test_contention_splits_alltoall_time_by_a_concurrent_allreduce() -> None:
    events = [TimelineEvent("alltoall", 0.0, 1.0), TimelineEvent("alltoall", 2.0, 2.5),
              TimelineEvent("allreduce", 0.9, 1.5), TimelineEvent("experts", 1.0, 2.0)]
    seconds = contention_seconds(events)
    assert seconds["all_to_all_with_allreduce"] == 1.0 and seconds["all_to_all_alone"] == 0.5
    assert (seconds["all_to_all_with_allreduce_ops"], seconds["all_to_all_alone_ops"]) == (1, 1)
    assert seconds["allreduce"] == pytest.approx(0.6) and seconds["allreduce_ops"] == 1


def _config(degree: int) -> TransformerConfig:
    return TransformerConfig.build(vocab_size=64, context=8, layers=2, heads=2, model_dim=16, hidden_dim=32,
                                   num_experts=4, capacity_factor=0.0, pipeline=degree, alltoall="linear",
                                   parallel="expert", expert_kernel="bmm")  # fixed: auto's measured choice
    # could differ between the modes' models and change the gradients' rounding


def _gradients(rank: int, world_size: int, mode: str, degree: int, own_group: Any) -> dict[str, Any]:
    import torch.distributed as dist

    model = MoETransformer(_config(degree), group=dist.group.WORLD, seed=3)
    experts = model.expert_parameter_names()
    scheduler = gradient_scheduler(mode, replicated_parameters(model, experts), own_group, world_size,
                                   model.groups.traffic, MICROOP_MB, BUCKET_MB)
    launched = []
    for step in range(2):  # the scheduler serves step after step
        model.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.start()
        batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step * 10 + rank))
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        synchronize_gradients(model, experts, dist.group.WORLD, world_size, scheduler)
        if scheduler is not None:
            launched.append(list(scheduler.launched))
    return {
        "grads": {name: p.grad.numpy().copy() for name, p in model.named_parameters()},
        "launched": launched, "pieces": len(scheduler.pieces) if scheduler is not None else 0,
    }


def _every_mode(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    own_group = dist.new_group(list(range(world_size)))
    return {(mode, degree): _gradients(rank, world_size, mode, degree, own_group) for degree in DEGREES
            for mode in MODES}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_overlap_and_lina_give_the_gradients_of_one_allreduce_after_the_backward(world_size: int) -> None:
    results = run_distributed(_every_mode, world_size)
    for rank, result in enumerate(results):
        for degree in DEGREES:
            after = result[("after", degree)]["grads"]
            for mode in ("overlap", "lina"):
                run = result[(mode, degree)]
                # every piece once, in order, each step: none lost, none applied twice
                assert run["launched"] == [list(range(run["pieces"]))] * 2, (mode, degree)
                for name, grad in after.items():
                    if world_size == 2:  # a sum of two values: the same whatever the order
                        np.testing.assert_array_equal(run["grads"][name], grad, err_msg=f"{mode} {degree} {name}")
                    else:
                        np.testing.assert_allclose(run["grads"][name], grad, rtol=1e-5, atol=1e-7,
                                                   err_msg=f"{mode} {degree} {name} rank {rank}")
        micro = result[("lina", 1)]["pieces"]
        assert micro > result[("overlap", 1)]["pieces"] > 1  # micro-ops are smaller than buckets


def _held_by_alltoall(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    weights = [torch.nn.Parameter(torch.full((300,), float(rank + 1))) for _ in range(3)]
    traffic = AllToAllTraffic()
    scheduler = gradient_scheduler("lina", weights, dist.new_group([0, 1]), world_size, traffic, 0.0004, 1.0)
    assert scheduler is not None
    scheduler.start()
    traffic.expect()  # a combine's backward began: an all-to-all is imminent
    sum(w.sum() for w in weights).backward()  # every gradient ready
    time.sleep(0.3)
    held = list(scheduler.launched)
    traffic.settle()  # the layer's backward is over
    deadline = time.monotonic() + 30
    while len(scheduler.launched) < len(scheduler.pieces) and time.monotonic() < deadline:
        time.sleep(0.01)
    released = list(scheduler.launched)
    scheduler.finish()
    return {"held": held, "released": released, "pieces": len(scheduler.pieces),
            "grad": weights[0].grad.numpy().copy()}


@pytest.mark.distributed
def test_lina_holds_micro_ops_while_an_alltoall_is_imminent_and_releases_them_after() -> None:
    for result in run_distributed(_held_by_alltoall, 2):
        assert result["held"] == [] and result["pieces"] == 3 * 3  # 300 floats in 400-byte micro-ops: 3 each
        assert result["released"] == list(range(result["pieces"]))  # before finish(): released by settle()
        np.testing.assert_array_equal(result["grad"], np.ones(300))  # the mean of 1 and 1 (grad of sum)


def test_after_mode_has_no_scheduler_and_bad_modes_name_the_choices() -> None:
    traffic = AllToAllTraffic()
    assert gradient_scheduler("after", [], None, 2, traffic, 1.0, 1.0) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad_sync='ddp'; choose one of after, overlap, lina"):
        gradient_scheduler("ddp", [], None, 2, traffic, 1.0, 1.0)  # type: ignore[arg-type]


def _dies_during_micro_ops(rank: int, world_size: int) -> None:
    import os

    import torch.distributed as dist

    weights = [torch.nn.Parameter(torch.ones(1 << 16)) for _ in range(4)]
    scheduler = gradient_scheduler("lina", weights, dist.new_group([0, 1]), world_size, AllToAllTraffic(), 0.01, 1.0)
    assert scheduler is not None
    scheduler.start()
    sum(w.sum() for w in weights).backward()  # rank 0's micro-ops start at once
    if rank == 1:
        time.sleep(0.05)
        os._exit(3)  # dies while its peer's micro-ops wait for it
    scheduler.finish()


@pytest.mark.distributed
def test_a_worker_that_dies_during_micro_ops_fails_the_job_fast() -> None:
    from moeflow.distributed import WorkerError

    began = time.monotonic()
    with pytest.raises(WorkerError, match="worker 1"):
        run_distributed(_dies_during_micro_ops, 2, timeout_s=120)
    assert time.monotonic() - began < 30


def _issue_points(rank: int, world_size: int, mode: str) -> list[tuple[str, int, int]]:
    """Where each gradient all-reduce of a training step is issued: (its thread, the layers'
    backward windows opened and closed before it)."""
    import threading

    import torch.distributed as dist

    from moeflow.training import grad_sync

    model = MoETransformer(_config(2), group=dist.group.WORLD, seed=3)
    experts = model.expert_parameter_names()
    scheduler = gradient_scheduler(mode, replicated_parameters(model, experts), dist.new_group([0, 1]), world_size,
                                   model.groups.traffic, MICROOP_MB, BUCKET_MB)
    assert scheduler is not None
    windows = [0, 0]
    expect, settle = model.groups.traffic.expect, model.groups.traffic.settle

    def counted(index: int, call: Any) -> Any:
        return lambda: (windows.__setitem__(index, windows[index] + 1), call())[1]

    model.groups.traffic.expect, model.groups.traffic.settle = counted(0, expect), counted(1, settle)
    points: list[tuple[str, int, int]] = []
    reduce = grad_sync.all_reduce

    def recorded(*args: Any, **kwargs: Any) -> Any:
        points.append((threading.current_thread().name, *windows))
        return reduce(*args, **kwargs)

    grad_sync.all_reduce = recorded
    try:
        scheduler.start()
        batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))
        model(batch[:, :-1], batch[:, 1:])[1].backward()
        synchronize_gradients(model, experts, dist.group.WORLD, world_size, scheduler)
    finally:
        grad_sync.all_reduce = reduce
    return points


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["overlap", "lina"])
def test_gradient_all_reduces_are_issued_at_the_same_points_of_the_backward_on_every_rank(mode: str) -> None:
    """NCCL's rule for several communicators: every rank enqueues the gradient all-reduces at the
    same places among the layers' all-to-alls, so they are issued on the backward's thread at
    points its graph fixes (a scheduler thread of their own issued them where its timing fell)."""
    first, second = run_distributed(_issue_points, 2, mode)
    assert first == second and len(first) > 1
    assert {thread for thread, *_ in first} == {"MainThread"}
    if mode == "lina":  # none issued inside a layer's backward window: each after as many settles as expects
        assert all(opened == closed for _, opened, closed in first[:-1])
