"""SAA equals all-gather(all-to-all(x)) done one after the other, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow.comm.alltoall import all_to_all
from moeflow.comm.saa import simultaneous_alltoall_allgather
from pool import run_distributed


def _groups(world: int, a2a_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """rank = mp * a2a_size + e: all-to-all among the same mp, all-gather among the same e."""
    mp_size = world // a2a_size
    mine_a2a = mine_mp = None
    for mp in range(mp_size):
        group = dist.new_group([mp * a2a_size + e for e in range(a2a_size)])
        if dist.get_rank() // a2a_size == mp:
            mine_a2a = group
    for e in range(a2a_size):
        group = dist.new_group([mp * a2a_size + e for mp in range(mp_size)])
        if dist.get_rank() % a2a_size == e:
            mine_mp = group
    assert mine_a2a is not None and mine_mp is not None
    return mine_a2a, mine_mp


def _check(rank: int, world: int) -> list[str]:
    failures = []
    for a2a_size in [d for d in range(1, world + 1) if world % d == 0]:
        a2a_group, mp_group = _groups(world, a2a_size)
        x = torch.randn(a2a_size * 3, 5, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        upstream = torch.randn(world * 3, 5, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)
        fused_in = x.clone().requires_grad_()
        fused = simultaneous_alltoall_allgather(fused_in, a2a_group, mp_group)
        (fused * upstream).sum().backward()
        # the sequential reference, from plain collectives (torch.distributed.nn's all_gather has a
        # backward that mistakes global for group ranks on subgroups, so the adjoint is written out)
        exchanged = all_to_all(x, a2a_group)
        parts = [torch.empty_like(exchanged) for _ in range(dist.get_world_size(mp_group))]
        dist.all_gather(parts, exchanged, group=mp_group)
        plain = torch.cat(parts)
        upstreams = [torch.empty_like(upstream) for _ in parts]
        dist.all_gather(upstreams, upstream, group=mp_group)
        me = dist.get_rank(mp_group)
        rows = exchanged.shape[0]
        summed = sum(u[me * rows : (me + 1) * rows] for u in upstreams)
        plain_grad = all_to_all(summed.contiguous(), a2a_group)
        if not torch.equal(fused, plain):
            failures.append(f"rank {rank} a2a={a2a_size}: output")
        if not torch.allclose(fused_in.grad, plain_grad, rtol=0, atol=1e-12):
            failures.append(f"rank {rank} a2a={a2a_size}: gradient")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_saa_equals_sequential_alltoall_then_allgather(world_size: int) -> None:
    failures = [f for rank_failures in run_distributed(_check, world_size, timeout_s=120) for f in rank_failures]
    assert not failures, "\n".join(failures)


def _combine_order(rank: int, world: int, esp_size: int, mp_size: int) -> tuple[list[str], bool]:
    """Parm's S2 combine with SAA where N_MP > N_ESP (the members of an MP group in different EP
    groups): the order this rank enqueues the exchanges ("x") and the MP all-gathers ("g"), and
    whether the result equals the serial combine then all-gather."""
    from moeflow.comm import saa
    from moeflow.comm.ep_esp import ep_esp_combine

    mp_groups = [dist.new_group(list(range(first, first + mp_size))) for first in range(0, world, mp_size)]
    mp_group = mp_groups[rank // mp_size]
    local, capacity, model_dim = 2, 3, 4
    partial = torch.randn(local, world * capacity, model_dim, generator=torch.Generator().manual_seed(rank))
    order: list[str] = []
    exchange, gather = saa.dist.batch_isend_irecv, saa.dist.all_gather_single
    saa.dist.batch_isend_irecv = lambda ops: order.append("x") or exchange(ops)
    saa.dist.all_gather_single = lambda *args, **kwargs: order.append("g") or gather(*args, **kwargs)
    try:
        fused = saa.ep_esp_combine_allgather(partial, esp_size, capacity, dist.group.WORLD, mp_group)
    finally:
        saa.dist.batch_isend_irecv, saa.dist.all_gather_single = exchange, gather
    combined = ep_esp_combine(partial, world // esp_size, esp_size, capacity, dist.group.WORLD)
    parts = [torch.empty_like(combined) for _ in range(mp_size)]
    dist.all_gather(parts, combined.contiguous(), group=mp_group)
    serial = torch.stack(parts, 1).reshape(combined.shape[0], mp_size * capacity, model_dim)
    return order, torch.equal(fused, serial)


@pytest.mark.distributed
def test_the_members_of_an_mp_group_enqueue_the_s2_combines_collectives_in_one_order() -> None:
    """N_ESP 1, N_MP 2 on 4 ranks: ranks 0 and 1 share an MP group but not an EP group. Each used to
    all-gather a block as soon as it held it, at different places among the exchanges."""
    results = run_distributed(_combine_order, 4, 1, 2)
    assert all(equal for _, equal in results)
    assert results[0][0] == results[1][0] and results[2][0] == results[3][0], [order for order, _ in results]
