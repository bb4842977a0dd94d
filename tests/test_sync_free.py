"""A training step on one rank keeps the GPU's queue full: past the one read of the routing counts
(capacity and the statistics need them on the host), nothing in the forward or backward waits for
the device. On a GPU each such wait drains the queue and leaves the device idle while the host
prepares the next launches (a third of a 64-expert layer's step on an H200, 2026-11-27).

These run on the CPU: they count the operators that synchronize on CUDA whatever their input
(a boolean index, ``nonzero``, ``bincount``, ``masked_select``/``masked_scatter``), as dispatched;
for the dedup exchange, whose routes are host work by design, the reads of a tensor that stands
for device values.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.core.routing import assign_slots
from moeflow.core.routing.slots import expert_counts
from moeflow.core.slot_map import make_slot_map
from moeflow.kernels.choice import KernelChoice
from pool import run_distributed

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


class _DeviceValues(torch.Tensor):
    """A tensor that stands for one on a GPU: it counts every read of its values by the host (each
    a wait for the device on CUDA); what a read returns is a plain (host) tensor."""

    reads: ClassVar[list[str]] = []  # per worker process: one job at a time

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", str(func))
        result = super().__torch_function__(func, types, args, kwargs or {})
        if name in ("cpu", "tolist", "item", "numpy", "__int__", "__index__", "__bool__", "__float__"):
            cls.reads.append(name)
            return result.as_subclass(torch.Tensor) if isinstance(result, torch.Tensor) else result
        if name == "to" and isinstance(result, torch.Tensor) and result.device.type == "cpu":
            cls.reads.append(name)
            return result.as_subclass(torch.Tensor)
        return result


def _host_reads(rank: int, world_size: int) -> list[str]:
    """The dedup exchange's routes for one forward, from slot tokens that stand for device values."""
    from moeflow.parallel.dedup_exchange import DedupExchange

    filled_WE = torch.tensor([[3, 2, 3, 1], [3, 2, 3, 1]])
    tokens_EC = torch.tensor([[0, 1, 2], [0, 1, 9], [3, 4, 0], [3, 9, 9]])  # 0, 1 and 3 twice on a rank
    _DeviceValues.reads = []
    exchange = DedupExchange.build(ParallelGroups(dist.group.WORLD, Topology(world_size, world_size)), "linear",
                                   filled_WE, tokens_EC.reshape(-1).as_subclass(_DeviceValues), [(0, 2), (2, 3)])
    assert exchange.saved_rows > 0
    return list(_DeviceValues.reads)


@pytest.mark.distributed
def test_the_dedup_exchange_reads_the_device_once_per_forward() -> None:
    """Its routes need the slots' token indices on the host: one read of them per forward (it read
    them twice)."""
    assert run_distributed(_host_reads, 2) == [["cpu"], ["cpu"]]
