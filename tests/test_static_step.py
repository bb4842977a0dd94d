"""``step_shapes="static"``: a step on one rank sized from its shapes alone, so that a CUDA graph can
capture it. It computes the reference function (drops included), reads nothing on the host, and is
refused where it cannot run."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow import MoELayer
from moeflow.config import MoEConfig
from moeflow.core.routing import assign_slots
from moeflow.core.slot_map import make_slot_map, make_static_slot_map
from moeflow.moe.cuda_graph import graphed_layer
from pool import run_distributed

from equivalence import check_cases, static_cases

HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_static_steps_match_the_reference_on_one_process() -> None:
    cases = static_cases()
    count, failures = check_cases(0, 1, cases)
    assert count == len(cases) and not failures, "\n".join(failures[:20])


@pytest.mark.distributed
def test_static_steps_match_the_reference_on_one_gloo_rank() -> None:
    cases = static_cases()
    [(count, failures)] = run_distributed(check_cases, 1, cases, timeout_s=120)
    assert count == len(cases) and not failures, "\n".join(failures[:20])


class _ScalarReads(TorchDispatchMode):
    """Counts the operators by which the host reads a tensor's value (``item``, ``int()``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func) in ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.bincount.default"):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _host_reads() -> Iterator[list[str]]:
    """Every Python-level read of a tensor's values (and the dispatched scalar reads) inside the block."""
    seen: list[str] = []

    def watching(name: str):  # type: ignore[no-untyped-def]
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(name)
            return original(self, *args, **kwargs)
        return read

    with pytest.MonkeyPatch.context() as patch:  # undone exactly: the methods torch.Tensor inherits stay inherited
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, watching(name))
        with _ScalarReads() as scalars:
            yield seen
    seen.extend(scalars.seen)


@pytest.mark.parametrize("moves_bias", [False, True])
def test_a_static_step_reads_nothing_on_the_host(moves_bias: bool) -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 8, top_k=2, capacity_factor=0.75, activation="swiglu", step_shapes="static",
                     kernel_backend="torch", expert_bias_update_rate=0.01 if moves_bias else 0.0)
    x = torch.randn(40, 16)

    def step() -> None:
        leaf = x.detach().requires_grad_()
        ((layer(leaf) ** 2).sum() + layer.aux_loss).backward()

    step()
    with _host_reads() as seen:
        step()
    assert not seen, f"host reads in a static step: {seen}"
    stats = layer.last_stats  # read after the step: the counts come to the host now
    assert stats.plan.source == "static" and stats.plan.expert_kernel == "bmm" and stats.dropped > 0
    assert stats.plan.kernels["encode"] == stats.plan.kernels["decode"] == "gather"


def test_the_watch_sees_a_host_read() -> None:
    with _host_reads() as seen:
        values = torch.arange(4)
        values.tolist(), int(values[0]), values.max().item()
    assert seen.count("tolist") == 1 and "aten._local_scalar_dense.default" in seen


@pytest.mark.parametrize("capacity", [1, 3, 12])
def test_the_static_plan_keeps_the_slots_the_counted_plan_keeps(capacity: int) -> None:
    generator = torch.Generator().manual_seed(capacity)
    tokens, experts, k = 17, 5, 3
    expert_idx = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    location, _ = assign_slots(expert_idx, experts)
    counted, static = (plan(expert_idx, location, experts, capacity) for plan in (make_slot_map, make_static_slot_map))
    assert torch.equal(static.choice_mask_TK, counted.choice_mask_TK)
    kept = static.choice_mask_TK.flatten()
    assert torch.equal(static.slot_idx_N[kept], counted.slot_idx_N) and torch.equal(static.token_idx_N[kept],
                                                                                     counted.token_idx_N)
    occupied = torch.zeros(experts * capacity, dtype=torch.bool).index_fill_(0, counted.slot_idx_N, True)
    assert torch.equal(static.occupied_S, occupied)
    assert torch.equal(static.slot_token_S[occupied], counted.slot_token_S[occupied])
    assert static.slot_idx_N.numel() == tokens * k  # the shape is the call's alone


def test_auto_keeps_the_dynamic_step_on_a_cpu() -> None:
    layer = MoELayer(16, 32, 8, top_k=2, capacity_factor=1.0)
    assert layer.config.step_shapes == "auto"
    leaf = torch.randn(12, 16, requires_grad=True)
    layer(leaf).sum().backward()
    assert layer.last_stats.plan.source != "static"


def test_static_refuses_a_capacity_read_from_the_routing() -> None:
    with pytest.raises(ValueError, match="step_shapes='static' sizes capacity from capacity_factor > 0"):
        MoEConfig(16, 32, 8, capacity_factor=0.0, step_shapes="static")
    layer = MoELayer(16, 32, 8, step_shapes="static")
    with pytest.raises(ValueError, match=r"capacity_factor=0\.0: pass one > 0 or use step_shapes='auto'"):
        layer(torch.randn(4, 16, requires_grad=True), capacity_factor=0.0)
    with pytest.raises(ValueError, match="unknown step_shapes 'fixed'; choose one of"):
        MoEConfig(16, 32, 8, step_shapes="fixed")


def _static_on_two_ranks(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    try:
        MoELayer(16, 32, 8, step_shapes="static", group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "built"


@pytest.mark.distributed
def test_static_refuses_several_ranks() -> None:
    for message in run_distributed(_static_on_two_ranks, 2, timeout_s=60):
        assert "runs on one rank that holds every expert" in message and "step_shapes='auto'" in message


def test_graphed_layer_needs_a_cuda_tensor_and_a_static_step() -> None:
    layer = MoELayer(16, 32, 8, step_shapes="static")
    with pytest.raises(ValueError, match="CUDA tensor"):
        graphed_layer(layer, torch.randn(4, 16))
    dynamic = MoELayer(dataclasses.replace(layer.config, step_shapes="dynamic"))
    with pytest.raises(ValueError, match="step_shapes"):
        graphed_layer(dynamic, torch.randn(4, 16))
