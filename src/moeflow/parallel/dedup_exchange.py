"""The deduplicated token exchange (DeepEP's dispatch and combine): a token crosses to each rank once.

Under top-k routing a token whose choices include several experts of one rank fills several of
that rank's slots, and the ragged exchange (:mod:`moeflow.parallel.ragged_exchange`) sends its row
once per slot, both ways. Here the dispatch sends each (token, destination rank) pair once and the
receiver copies the row into every slot it fills; the experts' outputs are scaled by their gate
weights there (the pipeline's ``scale_LWC``; the weights travel once per forward, 4 bytes a kept
slot in fp32) and the combine sums a token's slots before one row goes back, into the slot it was
sent from: the schedule's combined buffer then carries the gate weights
(``ScheduleOutput.weighted``) and the layer's decode only sums. The combine is the dispatch's
adjoint and the reverse, so the backward's two exchanges send one row per (token, rank) as well;
the gate weights' gradient is computed where the experts ran and travels back once.

Deduplication is per capacity chunk of the pipeline: a token's copies in two chunks travel twice
(at degree 1, never).

The receiver must know which of its slots hold the same token. Once per forward each rank sends
the token index (its own numbering) of every kept slot to the slot's rank, 4 bytes a row in one
ragged all-to-all, and all-gathers how many rows it sends each rank in each chunk (the split
matrix every algorithm reads; 2DH reads other ranks' rows, and the layer's statistics sum it).
Both sides order a block's rows by token index, so they agree on the order without sending it.
The routes are built on the host, like the ragged exchange's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.algorithms import SplitMatrix, exchange, transpose
from moeflow.comm.collectives import all_gather_into, all_to_all_single, host_device
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.config import EXACT_WIRE
from moeflow.core.device_copy import to_device
from moeflow.parallel.chunk_pipeline import SelfAdjointExchange
from moeflow.parallel.node_dedup import NodeRoutes, node_routes
from moeflow.parallel.ragged_exchange import (
    RaggedRoutes,
    distinct_tokens,
    ragged_combine,
    ragged_dispatch,
    ragged_routes,
    scatter_rows,
    summed_rows,
)

HIERARCHICAL = "2dh"
"""The all-to-all whose two hops the dedup exchange runs node by node (:mod:`moeflow.parallel.node_dedup`)."""
TOKEN_INDEX_BYTES = 4
"""Bytes of one kept slot's token index in the per-forward index exchange (int32)."""


@dataclass(frozen=True)
class DedupRoutes:
    """One chunk's routes: the ragged exchange's (every kept slot), and the rows that travel once
    per (token, rank) on both sides."""

    ragged: RaggedRoutes
    unique_sent_U: torch.Tensor  # chunk rows (flat E * Cj) this rank sends, one per (token, rank), by destination
    copy_of_N: torch.Tensor  # each received kept slot (in ragged.received_N's order): its row among the received
    matrix: SplitMatrix  # matrix[s][d]: rows rank s sends rank d, one per (token, rank)
    algorithm: str

    @property
    def saved_rows(self) -> int:
        """Rows of the chunk's dispatch, all ranks, that did not travel because a copy did."""
        return sum(map(sum, self.ragged.matrix)) - sum(map(sum, self.matrix))

    def dispatch(self, chunk_ECM: torch.Tensor, groups: ParallelGroups, local_experts: int,
                 wire_dtype: str) -> torch.Tensor:
        """Each (token, rank) row once, copied into every slot of the token there."""
        _, slots, model_dim = chunk_ECM.shape
        device = chunk_ECM.device
        sent_UM = chunk_ECM.reshape(-1, model_dim).index_select(0, to_device(self.unique_sent_U, device))
        received_UM = exchange(self.algorithm, sent_UM, groups, self.matrix, wire_dtype)
        copies_NM = received_UM.index_select(0, to_device(self.copy_of_N, device))
        shape = (local_experts, groups.size * slots, model_dim)
        return scatter_rows(copies_NM, to_device(self.ragged.received_N, device), shape)

    def combine(self, y_LXM: torch.Tensor, rows: int, groups: ParallelGroups, wire_dtype: str) -> torch.Tensor:
        """The dispatch's adjoint: a token's slots summed on the experts' rank, one row back, in the
        slot the dispatch sent it from (its other slots zero)."""
        local, _, model_dim = y_LXM.shape
        device = y_LXM.device
        slots_NM = y_LXM.reshape(-1, model_dim).index_select(0, to_device(self.ragged.received_N, device))
        summed_UM = summed_rows(slots_NM, self.copy_of_N, sum(row[groups.rank] for row in self.matrix))
        returned_UM = exchange(self.algorithm, summed_UM, groups, transpose(self.matrix), wire_dtype)
        shape = (local * groups.size, rows, model_dim)
        return scatter_rows(returned_UM, to_device(self.unique_sent_U, device), shape)


def _sender_side(tokens_N: torch.Tensor, sent_N: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The chunk rows this rank sends, one per (token, destination), and how many to each rank."""
    rows, sizes = [], []
    for block_tokens, block_sent in zip(tokens_N.split(counts), sent_N.split(counts), strict=True):
        *_, first = distinct_tokens(block_tokens)
        rows.append(block_sent[first])
        sizes.append(len(first))
    return torch.cat(rows), sizes


def _receiver_side(tokens_N: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """For each kept slot received, its row among the distinct rows received; and how many from each rank."""
    copies, sizes, offset = [], [], 0
    for block_tokens in tokens_N.split(counts):
        distinct, copy_of, _ = distinct_tokens(block_tokens)
        copies.append(copy_of + offset)
        sizes.append(len(distinct))
        offset += len(distinct)
    return torch.cat(copies), sizes


def _exchange_token_indices(groups: ParallelGroups, whole: RaggedRoutes, slot_tokens_EC: torch.Tensor) -> torch.Tensor:
    """Every kept slot's token index from its sender (by ``whole``, the whole capacity's ragged
    routes), laid out (L, W, C) as the receiver's experts see them (-1: an empty slot): one ragged
    all-to-all of host values."""
    experts, capacity = slot_tokens_EC.shape
    world, rank = groups.size, groups.rank
    device = host_device(groups.expert)
    sent = slot_tokens_EC.reshape(-1)[whole.sent_N].to(device=device, dtype=torch.int32)
    received = sent.new_empty(sum(row[rank] for row in whole.matrix))
    with groups.ledger.tracked("all-to-all", groups.expert, len(sent) * TOKEN_INDEX_BYTES):
        all_to_all_single(received, sent, groups.expert, [row[rank] for row in whole.matrix], whole.matrix[rank])
    layout = torch.full((experts // world * world * capacity,), -1, dtype=torch.int64)
    layout[whole.received_N] = received.cpu().long()
    return layout.view(experts // world, world, capacity)


def dedup_routes(
    groups: ParallelGroups, algorithm: str, filled_WE: torch.Tensor, slot_tokens_EC: torch.Tensor,
    chunks: list[tuple[int, int]], whole: RaggedRoutes,
) -> dict[tuple[int, int], DedupRoutes]:
    """Every chunk's routes for one forward, keyed (start, slots); ``whole``: the whole capacity's
    ragged routes; ``slot_tokens_EC`` on the host. Collective: every rank of the expert group calls
    it with the same ``filled_WE`` and ``chunks``."""
    if not chunks:  # no capacity: nothing travels (every rank agrees the capacity)
        return {}
    rank = groups.rank
    received_LWC = _exchange_token_indices(groups, whole, slot_tokens_EC)
    built = []
    for start, stop in chunks:
        ragged = ragged_routes(filled_WE, rank, start, stop - start)
        sent_tokens = slot_tokens_EC[:, start:stop].reshape(-1)[ragged.sent_N]
        unique_sent, send_sizes = _sender_side(sent_tokens, ragged.sent_N, ragged.matrix[rank])
        received_tokens = received_LWC[:, :, start:stop].reshape(-1)[ragged.received_N]
        copy_of, receive_sizes = _receiver_side(received_tokens, [row[rank] for row in ragged.matrix])
        built.append((ragged, unique_sent, copy_of, send_sizes, receive_sizes))
    sizes = [(send, receive) for *_, send, receive in built]
    matrices = _all_gather_sizes(groups, sizes, len(chunks))
    routes = {}
    for (ragged, unique_sent, copy_of, *_), matrix, (start, stop) in zip(built, matrices, chunks, strict=True):
        routes[(start, stop - start)] = DedupRoutes(ragged, unique_sent, copy_of, matrix, algorithm)
    return routes


def _all_gather_sizes(
    groups: ParallelGroups, sizes: list[tuple[list[int], list[int]]], chunks: int
) -> list[SplitMatrix]:
    """Every rank's rows to every rank in each chunk: matrices[chunk][s][d], from one all-gather of
    what each rank sends and expects to receive. Every rank checks every pair with the same numbers,
    so a disagreement fails the job on every rank at once, naming the ranks (a check that failed
    on one rank alone left its peers waiting in the next all-to-all until the timeout)."""
    world = groups.size
    local = torch.tensor(sizes, dtype=torch.int64, device=host_device(groups.expert)).reshape(-1)
    gathered = local.new_empty(world * local.numel())
    with groups.ledger.tracked("all-gather", groups.expert, local.numel() * 8):
        all_gather_into(gathered, local, groups.expert)
    by_rank = gathered.cpu().view(world, chunks, 2, world)
    sends, receives = by_rank[:, :, 0], by_rank[:, :, 1]  # (s, chunk, d) and (d, chunk, s)
    disagree = (sends != receives.permute(2, 1, 0)).nonzero().tolist()
    if disagree:  # both sides derive the blocks alike: a difference is a bug, the same on every rank
        source, chunk, dest = disagree[0]
        raise RuntimeError(
            f"dedup exchange: rank {dest} expects {int(receives[dest, chunk, source])} rows from rank {source} "
            f"in chunk {chunk}, which sends {int(sends[source, chunk, dest])}"
        )
    return [sends[:, chunk].tolist() for chunk in range(chunks)]


class _SlotValuesToExperts(torch.autograd.Function):
    """One value per slot of the sender's (E, C) buffer to the experts' (L, W, C) layout of the
    receiver (the gate weights the experts' rank applies): a ragged exchange, its adjoint sends the
    gradients back."""

    @staticmethod
    def forward(ctx: FunctionCtx, values_S: torch.Tensor, routes: RaggedRoutes, groups: ParallelGroups,
                num_experts: int, capacity: int) -> torch.Tensor:
        ctx.routes, ctx.groups = routes, groups
        received = ragged_dispatch(routes, values_S.view(num_experts, capacity, 1), groups, "linear", EXACT_WIRE)
        return received.view(num_experts // groups.size, groups.size, capacity)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_LWC: torch.Tensor):  # type: ignore[override]
        local, world, capacity = grad_LWC.shape
        grad_LX1 = grad_LWC.reshape(local, world * capacity, 1)
        returned = ragged_combine(ctx.routes, grad_LX1, capacity, ctx.groups, "linear", EXACT_WIRE)
        return returned.reshape(-1), None, None, None, None


@dataclass(frozen=True)
class DedupExchange(SelfAdjointExchange):
    """An expert-parallel exchange over ``groups.expert`` that sends a token once to each rank both
    ways (:func:`dedup_routes` per chunk of one forward), or under the 2DH algorithm once to each
    node (:func:`moeflow.parallel.node_dedup.node_routes`): the dispatch copies a received row into
    every slot of its token, the combine sums those slots' outputs, scaled by their gate weights in
    the pipeline (:meth:`gate_weights`), before one row goes back. Each is the other's adjoint.
    ``saved_rows``: the rows one all-to-all of the ragged exchange would send that this one does
    not; ``cross_node_rows``: the rows its dispatch sends between nodes (both over all ranks and
    chunks, read from ``totals`` when asked)."""

    groups: ParallelGroups
    routes: Mapping[tuple[int, int], DedupRoutes | NodeRoutes]
    whole: RaggedRoutes  # the whole capacity's ragged routes (the gate weights travel by them)
    capacity: int
    num_local_experts: int
    totals: Callable[[], tuple[int, int]]  # (saved_rows, cross_node_rows), read when asked
    slots: tuple[int, int] | None = None
    wire_dtype: str = EXACT_WIRE

    @classmethod
    def build(
        cls, groups: ParallelGroups, algorithm: str, filled_WE: torch.Tensor, slot_tokens_S: torch.Tensor,
        chunks: list[tuple[int, int]], wire_dtype: str = EXACT_WIRE,
    ) -> DedupExchange:
        """One forward's exchange over ``chunks`` of the (E, C) buffer whose slots hold ``slot_tokens_S``."""
        experts = filled_WE.shape[1]
        capacity = chunks[-1][1] if chunks else 0
        if slot_tokens_S.numel() != experts * capacity:
            raise ValueError(f"slot tokens ({slot_tokens_S.numel()}) must number E * C = {experts} * {capacity}")
        slot_tokens_EC = slot_tokens_S.view(experts, capacity).cpu()  # the forward's one wait for the device
        whole = ragged_routes(filled_WE, groups.rank, 0, capacity)
        routes: Mapping[tuple[int, int], DedupRoutes | NodeRoutes]
        totals: Callable[[], tuple[int, int]]
        if algorithm == HIERARCHICAL:
            routes, totals = node_routes(groups, filled_WE, slot_tokens_EC, chunks)
        else:
            routes = dedup_routes(groups, algorithm, filled_WE, slot_tokens_EC, chunks, whole)
            counted = (sum(route.saved_rows for route in routes.values()), _crossed(routes.values(), groups.topology))
            totals = lambda: counted  # noqa: E731 - every rank holds the matrices: nothing to wait for
        return cls(groups, routes, whole, capacity, experts // groups.size, totals, wire_dtype=wire_dtype)

    @property
    def saved_rows(self) -> int:
        """The rows one all-to-all of the ragged exchange would send that this one does not, over all
        ranks and chunks (under 2DH this reads an all-reduce issued in :meth:`build`)."""
        return self.totals()[0]

    @property
    def cross_node_rows(self) -> int:
        """The rows the dispatch sends between nodes, over all ranks and chunks (as :attr:`saved_rows`)."""
        return self.totals()[1]

    def gate_weights(self, slot_weights_S: torch.Tensor) -> torch.Tensor:
        """Each slot's gate weight where its expert runs, (L, W, C) (differentiable): what the
        pipeline scales the outputs by before this exchange sums them."""
        experts = self.num_local_experts * self.groups.size
        return _SlotValuesToExperts.apply(slot_weights_S, self.whole, self.groups, experts, self.capacity)

    def chunk(self, start: int, stop: int) -> DedupExchange:
        return dataclasses.replace(self, slots=(start, stop))

    def _route(self, slots: int) -> DedupRoutes | NodeRoutes:
        return self.routes[(self.slots[0] if self.slots is not None else 0, slots)]

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        route = self._route(chunk_ECM.shape[1])
        return route.dispatch(chunk_ECM, self.groups, self.num_local_experts, self.wire_dtype)

    def from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        return self._route(rows).combine(y_LXM, rows, self.groups, self.wire_dtype)


def _crossed(routes: Iterable[DedupRoutes], topology: Topology) -> int:
    """Rows the dispatch sends between nodes, all ranks, all chunks."""
    node = [topology.node_of(rank) for rank in range(topology.world_size)]
    return sum(rows for route in routes for source, row in enumerate(route.matrix)
               for dest, rows in enumerate(row) if node[source] != node[dest])
