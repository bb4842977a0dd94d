"""Parm's fused EP&ESP all-to-all against its definition, computed from every rank's seeded data."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow.comm.ep_esp import ep_esp_combine, ep_esp_dispatch
from pool import run_distributed

CAPACITY, MODEL_DIM, LOCAL = 3, 4, 2


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(rank: int, world: int, ep_size: int, esp_size: int) -> list[str]:
    experts, c = ep_size * LOCAL, CAPACITY
    p = rank // esp_size
    failures = []
    # dispatch: every ESP shard of group p gets every rank's tokens for the experts of p
    buffers = [_data(w, experts, c, MODEL_DIM) for w in range(world)]
    upstreams = [_data(100 + w, LOCAL, world * c, MODEL_DIM) for w in range(world)]
    mine = buffers[rank].clone().requires_grad_()
    out = ep_esp_dispatch(mine, ep_size, esp_size, dist.group.WORLD)
    (out * upstreams[rank]).sum().backward()
    expected = torch.cat([buffers[w][p * LOCAL : (p + 1) * LOCAL] for w in range(world)], dim=1)
    expected_grad = torch.cat([
        sum(upstreams[q * esp_size + s][:, rank * c : (rank + 1) * c] for s in range(esp_size))
        for q in range(ep_size)
    ])
    if not torch.equal(out, expected):
        failures.append(f"rank {rank} ep{ep_size}xesp{esp_size}: dispatch output")
    if not torch.allclose(mine.grad, expected_grad, rtol=0, atol=1e-12):
        failures.append(f"rank {rank} ep{ep_size}xesp{esp_size}: dispatch gradient")
    # combine: each rank's tokens get the sum of the partials of every shard of the expert's group
    partials = [_data(200 + w, LOCAL, world * c, MODEL_DIM) for w in range(world)]
    heads = [_data(300 + w, experts, c, MODEL_DIM) for w in range(world)]
    mine = partials[rank].clone().requires_grad_()
    combined = ep_esp_combine(mine, ep_size, esp_size, c, dist.group.WORLD)
    (combined * heads[rank]).sum().backward()
    expected = torch.cat([
        sum(partials[q * esp_size + s][:, rank * c : (rank + 1) * c] for s in range(esp_size))
        for q in range(ep_size)
    ])
    expected_grad = torch.cat([heads[w][p * LOCAL : (p + 1) * LOCAL] for w in range(world)], dim=1)
    if not torch.allclose(combined, expected, rtol=0, atol=1e-12):
        failures.append(f"rank {rank} ep{ep_size}xesp{esp_size}: combine output")
    if not torch.equal(mine.grad, expected_grad):
        failures.append(f"rank {rank} ep{ep_size}xesp{esp_size}: combine gradient")
    return failures


def _all_layouts(rank: int, world: int) -> list[str]:
    failures = []
    for ep_size in [d for d in range(1, world + 1) if world % d == 0]:
        failures += _check(rank, world, ep_size, world // ep_size)
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fused_ep_esp_alltoall_matches_its_definition(world_size: int) -> None:
    failures = [f for rank_failures in run_distributed(_all_layouts, world_size, timeout_s=120) for f in rank_failures]
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_bad_layouts_are_rejected() -> None:
    messages = run_distributed(_bad_layout, 2, timeout_s=120)
    assert all("ep_size * esp_size must equal the group size 2" in m for m in messages)


def _bad_layout(rank: int, world: int) -> str:
    try:
        ep_esp_dispatch(torch.zeros(4, 1, 1), ep_size=3, esp_size=1, group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"
