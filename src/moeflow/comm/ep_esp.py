"""Parm's fused EP&ESP all-to-all (III-C): one collective replaces ESP-AllGather + EP-AlltoAll
(dispatch) and EP-AlltoAll + ESP-ReduceScatter (combine).

Layout: W = N_EP * N_ESP ranks, rank = ep * N_ESP + esp (the ranks of one ESP group are contiguous,
so they share a node when N_ESP <= ranks per node: Parm's "Case 2"). The E experts are split over
the EP groups (E_local = E / N_EP each); every expert's hidden dimension is sharded over the N_ESP
ranks of its group, so each of them needs *all* tokens routed to the group's experts.

Shapes: E experts, C capacity, M model dim, L = E_local, X = W * C.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.comm.alltoall import all_to_all


def _check(world: int, ep_size: int, esp_size: int, experts: int) -> int:
    if ep_size < 1 or esp_size < 1 or ep_size * esp_size != world:
        raise ValueError(f"ep_size * esp_size must equal the group size {world}, got {ep_size} * {esp_size}")
    if experts % ep_size:
        raise ValueError(f"{experts} experts cannot be split over {ep_size} expert-parallel groups")
    return experts // ep_size


def ep_esp_dispatch(
    buffer_ECM: torch.Tensor, ep_size: int, esp_size: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """(E, C, M) by destination expert -> (L, W*C, M): every ESP shard of an expert receives the
    tokens of every rank for that expert. The local dump (duplicating each EP block for its N_ESP
    ranks) is an expand, so its gradient sums over the shards."""
    world = dist.get_world_size(group)
    experts, capacity, model_dim = buffer_ECM.shape
    local = _check(world, ep_size, esp_size, experts)
    dumped = (
        buffer_ECM.view(ep_size, 1, local, capacity, model_dim)
        .expand(ep_size, esp_size, local, capacity, model_dim)
        .reshape(world * local, capacity, model_dim)
    )
    received_WLCM = all_to_all(dumped, group).view(world, local, capacity, model_dim)
    return received_WLCM.transpose(0, 1).reshape(local, world * capacity, model_dim)


def ep_esp_combine(
    partial_LXM: torch.Tensor, ep_size: int, esp_size: int, capacity: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """(L, W*C, M) partial outputs of this rank's hidden shard -> (E, C, M) full outputs of this
    rank's tokens: one all-to-all returns every shard's partial, a local sum combines them."""
    world = dist.get_world_size(group)
    local, _, model_dim = partial_LXM.shape
    _check(world, ep_size, esp_size, local * ep_size)
    by_source = partial_LXM.view(local, world, capacity, model_dim).transpose(0, 1).contiguous()
    returned = all_to_all(by_source.view(world * local, capacity, model_dim), group)
    return returned.view(ep_size, esp_size, local, capacity, model_dim).sum(dim=1).reshape(
        ep_size * local, capacity, model_dim
    )
