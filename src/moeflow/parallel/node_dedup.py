"""Node-level deduplication for the hierarchical all-to-all: a token crosses to each node once
(DeepEP's internode dispatch and combine), for ``token_exchange='dedup'`` with ``alltoall='2dh'``.

The rank-level dedup exchange (:mod:`moeflow.parallel.dedup_exchange`) sends a token once to each
rank, so a token bound for two ranks of one node crosses the link between the nodes twice. Here the
dispatch takes two hops over the 2DH groups, in DeepEP's order (between nodes first):

1. **Between nodes** (the inter-node group: the ranks of this local rank on every node): a rank
   sends its peer on each node one row per (token, node) for the tokens any rank of that node needs.
2. **Inside the node** (the intra-node group): the peer forwards each row once to each rank of its
   node that needs it, which copies it into every slot of the token.

The combine is the dispatch's adjoint and runs the hops backwards: a rank sums a token's (scaled)
slots and sends one row to the peer it came through, the peer sums its node's rows of the token and
sends one row back across. Each hop is the linear all-to-all on its subgroup.

Metadata, once per forward, over the same two hops: every rank sends each node's peer the token
index of each of its slots for that node's experts (an equal-split all-to-all of the (E, C) grid of
int32, -1 for an empty slot), and the peer forwards each rank of its node the part for its experts.
Every hop's blocks are ordered by token index on both sides, so no order travels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeflow.comm.algorithms import exchange_on
from moeflow.comm.collectives import all_to_all_single, host_device, reduce_values_later
from moeflow.comm.groups import ParallelGroups, ProcessGroup
from moeflow.core.device_copy import to_device
from moeflow.parallel.ragged_exchange import RaggedRoutes, distinct_tokens, ragged_routes, scatter_rows, summed_rows


@dataclass(frozen=True)
class NodeHop:
    """One hop's split sizes on its subgroup: rows this rank sends each member, receives from each."""

    sends: list[int]
    receives: list[int]


@dataclass(frozen=True)
class NodeRoutes:
    """One chunk's two hops: the rows sent across (one per (token, node)), the rows forwarded inside
    the node (one per (token, rank)), and where each received slot's row lies."""

    ragged: RaggedRoutes  # the chunk's kept slots (the receiver's slot layout)
    across_U: torch.Tensor  # chunk rows (flat E * Cj) this rank sends across, by destination node
    across: NodeHop
    forward_V: torch.Tensor  # rows received across that this rank forwards, by destination local rank
    inside: NodeHop
    copy_of_N: torch.Tensor  # each received kept slot (ragged.received_N's order): its row among those forwarded

    def dispatch(self, chunk_ECM: torch.Tensor, groups: ParallelGroups, local_experts: int,
                 wire_dtype: str) -> torch.Tensor:
        """Across once per (token, node), inside once per (token, rank), into every slot of the token."""
        hops = groups.node_groups()
        _, slots, model_dim = chunk_ECM.shape
        device = chunk_ECM.device
        sent = chunk_ECM.reshape(-1, model_dim).index_select(0, to_device(self.across_U, device))
        arrived = exchange_on(hops.inter_node, sent, groups, self.across.receives, self.across.sends, wire_dtype)
        forwarded = arrived.index_select(0, to_device(self.forward_V, device))
        received = exchange_on(hops.intra_node, forwarded, groups, self.inside.receives, self.inside.sends, wire_dtype)
        copies_NM = received.index_select(0, to_device(self.copy_of_N, device))
        shape = (local_experts, groups.size * slots, model_dim)
        return scatter_rows(copies_NM, to_device(self.ragged.received_N, device), shape)

    def combine(self, y_LXM: torch.Tensor, rows: int, groups: ParallelGroups, wire_dtype: str) -> torch.Tensor:
        """The dispatch's adjoint: summed per (token, rank), sent to the peer, summed per (token, node), sent back."""
        hops = groups.node_groups()
        local, _, model_dim = y_LXM.shape
        device = y_LXM.device
        slots_NM = y_LXM.reshape(-1, model_dim).index_select(0, to_device(self.ragged.received_N, device))
        per_rank = summed_rows(slots_NM, self.copy_of_N, sum(self.inside.receives))
        back = exchange_on(hops.intra_node, per_rank, groups, self.inside.sends, self.inside.receives, wire_dtype)
        per_node = summed_rows(back, self.forward_V, sum(self.across.receives))
        returned = exchange_on(hops.inter_node, per_node, groups, self.across.sends, self.across.receives, wire_dtype)
        shape = (local * groups.size, rows, model_dim)
        return scatter_rows(returned, to_device(self.across_U, device), shape)


def _token_grids(groups: ParallelGroups, grid_EC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(for each source node, its peer's grid of this node's experts: (N, node's experts, C); for each
    rank of this node and each node, that source's grid of this rank's experts: (G, N, L, C)), over
    the two hops, equal splits of int32 on the group's host device."""
    hops, topology = groups.node_groups(), groups.topology
    nodes, per_node = topology.num_nodes, topology.ranks_per_node
    experts, capacity = grid_EC.shape
    local = experts // groups.size
    sent = grid_EC.to(dtype=torch.int32).contiguous()
    across = _equal_exchange(sent, hops.inter_node, groups)  # (source node, this node's experts, C)
    by_rank = across.view(nodes, per_node, local, capacity).transpose(0, 1).contiguous()  # (dest local rank, N, L, C)
    inside = _equal_exchange(by_rank, hops.intra_node, groups)
    return across.cpu().long().view(nodes, per_node * local, capacity), inside.cpu().long()


def _equal_exchange(sent: torch.Tensor, hop: ProcessGroup | None, groups: ParallelGroups) -> torch.Tensor:
    """An equal-split all-to-all of ``sent`` over one hop (None: this rank alone, kept), on the hop's
    host device (its own backend's, not the expert group's)."""
    if hop is None:
        return sent
    sent = sent.to(host_device(hop))
    received = torch.empty_like(sent)
    with groups.ledger.tracked("all-to-all", hop, sent.numel() * sent.element_size()):
        all_to_all_single(received, sent, hop)
    return received


def node_routes(
    groups: ParallelGroups, filled_WE: torch.Tensor, slot_tokens_EC: torch.Tensor, chunks: list[tuple[int, int]]
) -> tuple[dict[tuple[int, int], NodeRoutes], Callable[[], tuple[int, int]]]:
    """Every chunk's routes for one forward, keyed (start, slots), and a function that reads (the
    rows one all-to-all of the rank-level exchange would send that the last hop does not, the rows
    that cross between nodes), both over all ranks: their all-reduce is issued here and read when
    the statistics are (the forward does not wait for it). Collective over the expert group."""
    topology, rank = groups.topology, groups.rank
    if not chunks:  # no capacity: nothing travels (every rank agrees the capacity)
        return {}, lambda: (0, 0)
    per_node = topology.ranks_per_node
    experts, capacity = slot_tokens_EC.shape
    local = experts // groups.size
    node = topology.node_of(rank)
    slot_C = torch.arange(capacity)
    grid_EC = torch.where(slot_C < filled_WE[rank].unsqueeze(1), slot_tokens_EC.long(), -1)
    across_grids, my_grids = _token_grids(groups, grid_EC)
    routes, saved, crossed = {}, 0, 0
    for start, stop in chunks:
        chunk = _chunk_routes(filled_WE, rank, grid_EC, across_grids, my_grids, start, stop, per_node, local)
        routes[(start, stop - start)] = chunk
        crossed += sum(rows for other, rows in enumerate(chunk.across.sends) if other != node)
        saved += len(chunk.ragged.received_N) - sum(chunk.inside.receives)
    totals = reduce_values_later([saved, crossed], groups.expert)

    def read() -> tuple[int, int]:
        saved_all, crossed_all = totals()
        return int(saved_all), int(crossed_all)

    return routes, read


def _chunk_routes(
    filled_WE: torch.Tensor, rank: int, grid_EC: torch.Tensor, across_grids: torch.Tensor, my_grids: torch.Tensor,
    start: int, stop: int, per_node: int, local: int,
) -> NodeRoutes:
    slots = stop - start
    node_experts = per_node * local
    # the sender: one row per (token, node), the first slot holding it in each node's block
    across_U, across_sends = [], []
    for node_block in grid_EC[:, start:stop].split(node_experts):
        flat = node_block.reshape(-1)
        kept = (flat >= 0).nonzero().squeeze(1)
        _, _, first = distinct_tokens(flat[kept])
        across_U.append(kept[first] + len(across_U) * node_experts * slots)
        across_sends.append(len(first))
    # the peer: what each source node sends it, and what it forwards to each rank of its node
    arrived, offset = [], 0
    for grid in across_grids[:, :, start:stop]:
        flat = grid.reshape(-1)
        distinct = distinct_tokens(flat[flat >= 0])[0]
        arrived.append((distinct, offset))
        offset += len(distinct)
    forward_V, inside_sends = [], []
    for dest in range(per_node):
        rows = 0
        for (distinct, first_row), grid in zip(arrived, across_grids[:, dest * local:(dest + 1) * local, start:stop],
                                               strict=True):
            flat = grid.reshape(-1)
            needed = distinct_tokens(flat[flat >= 0])[0]
            forward_V.append(first_row + torch.searchsorted(distinct, needed))
            rows += len(needed)
        inside_sends.append(rows)
    # the receiver: from each peer (local rank g), its nodes' sources (n, g); the slots by source rank
    copies, inside_receives, row = {}, [], 0
    for peer, by_node in enumerate(my_grids[:, :, :, start:stop]):
        for source_node, grid in enumerate(by_node):
            flat = grid.reshape(-1)
            distinct, copy_of, _ = distinct_tokens(flat[flat >= 0])
            copies[(source_node, peer)] = copy_of + row
            row += len(distinct)
        inside_receives.append(row - sum(inside_receives))
    copy_of_N = torch.cat([copies[key] for key in sorted(copies)])  # source rank order: node-major
    return NodeRoutes(ragged_routes(filled_WE, rank, start, slots), torch.cat(across_U),
                      NodeHop(across_sends, [len(d) for d, _ in arrived]), torch.cat(forward_V),
                      NodeHop(inside_sends, inside_receives), copy_of_N)
