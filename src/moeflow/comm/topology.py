"""Cluster topology: rank -> (node, local rank), and the process subgroups the algorithms need.

Ranks are numbered node-major (rank = node * ranks_per_node + local_rank), as torchrun and the
testbed launch them. ``LOCAL_WORLD_SIZE`` (set by both) gives the ranks per node; without it the
whole world is one node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of ranks per node {self.ranks_per_node}; "
                "check LOCAL_WORLD_SIZE"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def rank_of(self, node: int, local_rank: int) -> int:
        return node * self.ranks_per_node + local_rank


def topology_from_env(world_size: int) -> Topology:
    """The topology of the running job: LOCAL_WORLD_SIZE ranks per node (default: one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return Topology(world_size, world_size)
    try:
        ranks_per_node = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {value!r}") from None
    return Topology(world_size, ranks_per_node)


@dataclass(frozen=True)
class NodeGroups:
    """This rank's intra-node group (same node) and inter-node group (same local rank)."""

    intra_node: dist.ProcessGroup
    inter_node: dist.ProcessGroup


_GROUP_CACHE: dict[tuple[int, int, int], NodeGroups] = {}


def node_groups(topology: Topology) -> NodeGroups:
    """Create (once per topology, on every rank in the same order) and return this rank's groups."""
    key = (id(dist.group.WORLD), topology.world_size, topology.ranks_per_node)
    if key not in _GROUP_CACHE:
        rank = dist.get_rank()
        intra = inter = None
        for node in range(topology.num_nodes):
            ranks = [topology.rank_of(node, local) for local in range(topology.ranks_per_node)]
            group = dist.new_group(ranks)
            if rank in ranks:
                intra = group
        for local in range(topology.ranks_per_node):
            ranks = [topology.rank_of(node, local) for node in range(topology.num_nodes)]
            group = dist.new_group(ranks)
            if rank in ranks:
                inter = group
        assert intra is not None and inter is not None
        _GROUP_CACHE[key] = NodeGroups(intra, inter)
    return _GROUP_CACHE[key]
