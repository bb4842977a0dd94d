"""Cluster topology: rank -> (node, local rank), and the process subgroups the algorithms need.

Ranks are numbered node-major (rank = node * ranks_per_node + local_rank), as torchrun and the
testbed launch them. ``LOCAL_WORLD_SIZE`` (set by both) gives the ranks per node; entry points read
it (:func:`topology_from_environment`) and pass the topology in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
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


def cross_node_rows(filled_WE: torch.Tensor, slots: int, ragged: bool, topology: Topology) -> int:
    """Token rows an expert-parallel dispatch of ``slots`` per column sends between nodes, over all
    ranks: the kept rows of the columns held on another node (ragged), or all their slots (padded)."""
    world, columns = filled_WE.shape
    node = torch.tensor([topology.node_of(rank) for rank in range(world)])
    elsewhere_WP = node.unsqueeze(1) != node.repeat_interleave(columns // world).unsqueeze(0)
    rows_WP = filled_WE.clamp(max=slots) if ragged else torch.full_like(filled_WE, slots)
    return int((rows_WP * elsewhere_WP).sum())


def gathered_cross_node_rows(tokens_W: list[int], topology: Topology) -> int:
    """Token rows an all-gather of every rank's tokens sends between nodes: each of rank s's
    ``tokens_W[s]`` rows to every rank on another node."""
    node = [topology.node_of(rank) for rank in range(len(tokens_W))]
    return sum(tokens * sum(other != node[source] for other in node) for source, tokens in enumerate(tokens_W))


def topology_from_environment(environment: Mapping[str, str], world_size: int) -> Topology:
    """The topology a launcher describes: ``LOCAL_WORLD_SIZE`` ranks per node (default: one node).
    Entry points pass ``os.environ``; library code receives the resulting :class:`Topology`."""
    value = environment.get("LOCAL_WORLD_SIZE")
    if value is None:
        return Topology(world_size, world_size)
    try:
        ranks_per_node = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {value!r}") from None
    return Topology(world_size, ranks_per_node)


@dataclass(frozen=True)
class NodeGroups:
    """This rank's intra-node group (same node) and inter-node group (same local rank); None for a
    hop of this rank alone (one node, or one rank per node), which moves nothing."""

    intra_node: dist.ProcessGroup | None
    inter_node: dist.ProcessGroup | None


def group_topology(members: Sequence[int], world: Topology) -> Topology:
    """The node layout of a group whose global ranks are ``members`` (by group rank) on the
    ``world``'s nodes: node-major, the same number of its ranks on each node it spans (what a
    DeviceMesh row or column of node-major ranks is); else a ValueError naming the layout."""
    nodes = [world.node_of(rank) for rank in members]
    counts = Counter(nodes)
    per_node = counts[nodes[0]]
    if list(members) != sorted(members) or any(count != per_node for count in counts.values()):
        raise ValueError(
            f"the group's ranks {list(members)} lie {dict(counts)} per node (of {world.ranks_per_node} ranks each): "
            "topology-aware all-to-alls need its ranks in node order with as many on every node it spans; "
            "lay the mesh out so that each expert group takes the same number of ranks from each node"
        )
    return Topology(len(members), per_node)
