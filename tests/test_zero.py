"""gather_shards: the forward is the concatenation of every rank's shard, and the backward gives
each shard the sum over ranks of its rows' gradients (1, 2 and 4 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow.comm.zero import gather_shards
from pool import run_distributed

SHARD_SHAPE = (2, 3, 4)


def _shard(rank: int) -> torch.Tensor:
    return torch.randn(SHARD_SHAPE, generator=torch.Generator().manual_seed(100 + rank))


def _coefficients(rank: int, world: int) -> torch.Tensor:
    shape = (world * SHARD_SHAPE[0], *SHARD_SHAPE[1:])
    return torch.randn(shape, generator=torch.Generator().manual_seed(200 + rank))


def _gather_and_differentiate(rank: int, world: int) -> list[str]:
    failures = []
    shard = _shard(rank).requires_grad_()
    full = gather_shards(shard, dist.group.WORLD)
    expected_full = torch.cat([_shard(r) for r in range(world)])
    if not torch.equal(full.detach(), expected_full):
        failures.append(f"rank {rank}: gathered tensor differs")
    (full.square() * _coefficients(rank, world)).sum().backward()  # each rank's own loss
    rows = slice(rank * SHARD_SHAPE[0], (rank + 1) * SHARD_SHAPE[0])
    expected_grad = sum(2 * expected_full[rows] * _coefficients(r, world)[rows] for r in range(world))
    assert shard.grad is not None
    if not torch.allclose(shard.grad, expected_grad, rtol=1e-6, atol=1e-6):
        failures.append(f"rank {rank}: gradient differs by {(shard.grad - expected_grad).abs().max():.3g}")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gather_shards_forward_and_gradient(world_size: int) -> None:
    results = run_distributed(_gather_and_differentiate, world_size, timeout_s=120)
    assert [f for failures in results for f in failures] == []
