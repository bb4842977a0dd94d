"""SAA equals all-gather(all-to-all(x)) done one after the other, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pool import run_distributed


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
    exchange, gather = saa.dist.batch_isend_irecv, saa.dist.all_gather_into_tensor
    saa.dist.batch_isend_irecv = lambda ops: order.append("x") or exchange(ops)
    saa.dist.all_gather_into_tensor = lambda *args, **kwargs: order.append("g") or gather(*args, **kwargs)
    try:
        fused = saa.ep_esp_combine_allgather(partial, esp_size, capacity, dist.group.WORLD, mp_group)
    finally:
        saa.dist.batch_isend_irecv, saa.dist.all_gather_into_tensor = exchange, gather
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
