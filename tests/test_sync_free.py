"""A training step on one rank keeps the GPU's queue full: past the one read of the routing counts
(capacity and the statistics need them on the host), nothing in the forward or backward waits for
the device. On a GPU each such wait drains the queue and leaves the device idle while the host
prepares the next launches (a third of a 64-expert layer's step on an H200, 2026-11-27).

These run on the CPU: they count the operators that synchronize on CUDA whatever their input
(a boolean index, ``nonzero``, ``bincount``, ``masked_select``/``masked_scatter``), as dispatched.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow import MoELayer
from moeflow.kernels.choice import KernelChoice
from moeflow.moe.dispatchers.slot_map import make_slot_map
from moeflow.moe.routing import assign_slots
from moeflow.moe.routing.slots import expert_counts

SYNCING = {"aten.nonzero.default", "aten.bincount.default", "aten.masked_select.default",
           "aten.masked_scatter.default", "aten.masked_scatter_.default", "aten.unique_consecutive.default"}


class _SyncingOps(TorchDispatchMode):
    """Counts the dispatched operators that would make a CUDA host wait."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        boolean_index = name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default") and any(
            index is not None and index.dtype == torch.bool for index in args[1])
        if name in SYNCING or boolean_index:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("expert_kernel", ["bmm", "ragged"])
@pytest.mark.parametrize("encode_decode", ["torch", "gather"])
def test_a_training_step_on_one_rank_issues_no_syncing_operator(expert_kernel: str, encode_decode: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 8, top_k=2, capacity_factor=0.75, activation="swiglu", pipeline=1, alltoall="linear",
                     expert_kernel=expert_kernel)
    choice = KernelChoice(encode_decode, encode_decode, "torch", "measured")  # what auto may pick on a GPU
    layer.kernel_table = SimpleNamespace(resolve=lambda setting, device, dtype: choice)
    x = torch.randn(40, 16)

    def step() -> None:
        leaf = x.detach().requires_grad_()
        ((layer(leaf) ** 2).sum() + layer.aux_loss).backward()

    step()  # the first step may measure or allocate
    watch = _SyncingOps()
    with watch:
        step()
    stats = layer.last_stats
    assert stats.plan.kernels["decode"] == encode_decode and stats.dropped > 0  # a plan with drops and empty slots
    assert not watch.seen, f"operators that synchronize on CUDA: {dict(watch.seen)}"


def test_the_watch_sees_a_syncing_operator() -> None:
    watch = _SyncingOps()
    with watch:
        values = torch.arange(6)
        values[values > 2].sum()
        torch.bincount(values)
    assert watch.seen == {"aten.index.Tensor": 1, "aten.bincount.default": 1}


@pytest.mark.parametrize("capacity", [1, 3, 5, 12])
def test_a_plan_built_from_the_host_count_equals_the_one_that_counts_on_the_device(capacity: int) -> None:
    generator = torch.Generator().manual_seed(capacity)
    tokens, experts, k = 17, 5, 3
    expert_idx = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    location, counts = assign_slots(expert_idx, experts)
    kept = int(counts.clamp(max=capacity).sum())
    counted, told = (make_slot_map(expert_idx, location, experts, capacity, kept=n) for n in (None, kept))
    for field in ("token_idx_N", "slot_idx_N", "choice_idx_N", "choice_mask_TK", "offsets_T", "slot_token_S",
                  "empty_slots"):
        assert torch.equal(getattr(counted, field), getattr(told, field)), field
    assert told.empty_slots.numel() == experts * capacity - kept


def test_expert_counts_equal_bincount() -> None:
    expert_idx = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(1))
    assert torch.equal(expert_counts(expert_idx, 9), torch.bincount(expert_idx.flatten(), minlength=9))
    assert torch.equal(expert_counts(expert_idx[:0], 4), torch.zeros(4, dtype=torch.int64))
