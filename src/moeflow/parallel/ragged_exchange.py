"""The ragged token exchange: only kept tokens cross the links (Megatron-Core's, DeepEP's and Tutel
0.3's ``all_to_all_v``).

The padded exchange sends every expert's (C, M) block whatever it holds, so its bytes are fixed by the
capacity: a dropless layer pads every expert to the busiest one, and a technique that moves fewer
tokens (EPLB's replicas, the topology gate, shadowing) moves the same bytes. Here each rank sends
each destination exactly its kept rows of that destination's experts: the per-expert counts are
all-gathered before the exchange already (``filled_WE``), so every rank knows every split and no
extra collective runs. Capacity is then a cap on kept tokens, not a buffer size.

The layouts on both sides stay those of :class:`~moeflow.parallel.chunk_pipeline.ExpertExchange`, (E, Cj, M) by
destination expert and (L, W * Cj, M) by local expert and source rank, so every expert kernel (the
ragged one skips the empty rows; the padded ones multiply zeros) and the pipeline's chunks run
unchanged: the rows are gathered before the all-to-all and scattered after it. Tokens fill an
expert's slots from the front (:func:`moeflow.kernels.slot_gather.make_slot_map`), so a chunk's rows of
(s, e) are its first ``clamp(filled[s, e] - start, 0, Cj)`` slots. The combine is the dispatch's
adjoint (gather, all-to-all over the transposed split matrix, scatter), so the exchange is its own
adjoint and the backward sends only the kept rows' gradients as well.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moeflow.comm.algorithms import SplitMatrix, exchange, transpose
from moeflow.comm.groups import ParallelGroups
from moeflow.config import EXACT_WIRE, RAGGED_MIN_SAVING, empty_share
from moeflow.core.device_copy import to_device
from moeflow.parallel.chunk_pipeline import ExpertExchange, SelfAdjointExchange


@dataclass(frozen=True)
class RaggedRoutes:
    """Where one chunk's kept rows sit on both sides of the exchange, as flat row indices (host)."""

    sent_N: torch.Tensor  # rows of the (E * Cj) dispatch chunk this rank sends, by destination rank
    received_N: torch.Tensor  # rows of the (L * W * Cj) expert layout it receives, by source rank
    matrix: SplitMatrix  # matrix[s][d]: rows rank s sends rank d


def ragged_routes(filled_WE: torch.Tensor, rank: int, start: int, slots: int) -> RaggedRoutes:
    """The routes of the chunk of capacity slots [start, start + slots) on ``rank`` of an
    expert-parallel placement (rank d holds experts [d L, (d + 1) L))."""
    world, experts = filled_WE.shape
    local = experts // world
    rows_WE = (filled_WE - start).clamp(0, slots)
    position = torch.arange(slots)
    sent_N = (position < rows_WE[rank].unsqueeze(1)).flatten().nonzero().squeeze(1)  # (e, j): e ascending
    mine_WL = rows_WE[:, rank * local:(rank + 1) * local]
    # the expert layout's flat index of (l, s, j) read in the received order (s, l, j)
    layout_WLc = torch.arange(local * world * slots).view(local, world, slots).transpose(0, 1)
    received_N = layout_WLc[position < mine_WL.unsqueeze(-1)]
    matrix = rows_WE.view(world, world, local).sum(2).tolist()
    return RaggedRoutes(sent_N, received_N, matrix)


def chunk_saving(filled_WE: torch.Tensor, start: int, slots: int) -> float:
    """The share of the chunk [start, start + slots)'s slots, over all ranks, that hold no token."""
    return empty_share(int((filled_WE - start).clamp(0, slots).sum()), filled_WE.numel(), slots)


def summed_rows(rows_NM: torch.Tensor, into_N: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows, row i the sum of the ``rows_NM`` whose ``into_N`` (host indices) is i: a
    token's copies, summed in fp32 (or wider) in the order they come, rounded once to the rows' dtype. Each
    copy gets a place of its own in a (count, most copies, M) grid (no atomic adds: CUDA's
    ``index_add_`` sums in the order its threads land, so a bf16 result changed from run to run and
    rounded at every add); the grid's sum is the same on every run."""
    into_N = into_N.cpu()
    place_N, most = _copy_places(into_N)
    model_dim = rows_NM.shape[-1]
    grid = rows_NM.new_zeros(count * most, model_dim)
    grid.index_copy_(0, to_device(into_N * most + place_N, rows_NM.device), rows_NM)
    accumulate = torch.promote_types(rows_NM.dtype, torch.float32)  # fp64 rows keep fp64
    return grid.view(count, most, model_dim).sum(dim=1, dtype=accumulate).to(rows_NM.dtype)


def _copy_places(into_N: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's place among the rows summed into the same row (0, 1, ... in their order), and the
    most rows summed into one (at least 1)."""
    if not len(into_N):
        return into_N.long(), 1
    order = torch.argsort(into_N, stable=True)
    sorted_into = into_N[order]
    first = torch.searchsorted(sorted_into, sorted_into)  # where each row's group starts in the sorted order
    place_N = torch.empty_like(order)
    place_N[order] = torch.arange(len(into_N)) - first
    return place_N, int(place_N.max()) + 1


def distinct_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the distinct tokens ascending, each position's distinct token, where each first occurs): the
    order both sides of a deduplicated block derive alike, so none travels."""
    distinct, copy_of = torch.unique(tokens, sorted=True, return_inverse=True)
    first = torch.full((len(distinct),), len(tokens), dtype=torch.int64)
    first.scatter_reduce_(0, copy_of, torch.arange(len(tokens)), reduce="amin")
    return distinct, copy_of, first


def scatter_rows(rows_NM: torch.Tensor, index_N: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero tensor of ``shape`` whose flat rows ``index_N`` are ``rows_NM``."""
    out = rows_NM.new_zeros(shape)
    out.view(-1, rows_NM.shape[-1]).index_copy_(0, index_N, rows_NM)
    return out


@dataclass(frozen=True)
class RaggedExpertExchange(SelfAdjointExchange):
    """An expert-parallel exchange over ``groups.expert`` that sends only the kept rows of each chunk
    (a chunk with fewer than ``min_saving`` of its slots empty goes padded). ``filled_WE[s, e]``:
    rank s's kept tokens of expert e (host, the same on every rank); ``slots`` the chunk's capacity
    range (set by :meth:`chunk`). Each chunk's routes are derived once per forward, shared by its
    dispatch, its combine and their backward (``routes``: None for a chunk that goes padded, whose
    routes are never built)."""

    groups: ParallelGroups
    algorithm: str
    filled_WE: torch.Tensor
    slots: tuple[int, int] | None = None
    min_saving: float = RAGGED_MIN_SAVING
    wire_dtype: str = EXACT_WIRE
    routes: dict[tuple[int, int], RaggedRoutes | None] = field(default_factory=dict, compare=False, repr=False)

    def chunk(self, start: int, stop: int) -> RaggedExpertExchange:
        return dataclasses.replace(self, slots=(start, stop))

    def _routes(self, slots: int) -> RaggedRoutes | None:
        """This chunk's routes, or None where it leaves too few slots empty to travel ragged (every
        rank decides alike, from the counts they all hold)."""
        start = self.slots[0] if self.slots is not None else 0
        key = (start, slots)
        if key not in self.routes:
            ragged = chunk_saving(self.filled_WE, start, slots) >= self.min_saving
            self.routes[key] = ragged_routes(self.filled_WE, self.groups.rank, start, slots) if ragged else None
        return self.routes[key]

    def _padded(self) -> ExpertExchange:
        return ExpertExchange(self.groups, self.algorithm, self.filled_WE.shape[1] // self.groups.size,
                              self.wire_dtype)

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        routes = self._routes(chunk_ECM.shape[1])
        if routes is None:
            return self._padded().to_experts(chunk_ECM)
        return ragged_dispatch(routes, chunk_ECM, self.groups, self.algorithm, self.wire_dtype)

    def from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        routes = self._routes(rows)
        if routes is None:
            return self._padded().from_experts(y_LXM, rows)
        return ragged_combine(routes, y_LXM, rows, self.groups, self.algorithm, self.wire_dtype)


def ragged_dispatch(
    routes: RaggedRoutes, chunk_ECM: torch.Tensor, groups: ParallelGroups, algorithm: str, wire_dtype: str
) -> torch.Tensor:
    """The chunk's kept rows sent to their experts' ranks, laid out (L, W * Cj, M) there."""
    experts, slots, model_dim = chunk_ECM.shape
    sent_NM = chunk_ECM.reshape(-1, model_dim).index_select(0, to_device(routes.sent_N, chunk_ECM.device))
    received_NM = exchange(algorithm, sent_NM, groups, routes.matrix, wire_dtype)
    shape = (experts // groups.size, groups.size * slots, model_dim)
    return scatter_rows(received_NM, to_device(routes.received_N, chunk_ECM.device), shape)


def ragged_combine(
    routes: RaggedRoutes, y_LXM: torch.Tensor, rows: int, groups: ParallelGroups, algorithm: str, wire_dtype: str
) -> torch.Tensor:
    """The dispatch's adjoint: each kept row's output back to its slot of the (E, Cj, M) chunk."""
    local, _, model_dim = y_LXM.shape
    out_NM = y_LXM.reshape(-1, model_dim).index_select(0, to_device(routes.received_N, y_LXM.device))
    returned_NM = exchange(algorithm, out_NM, groups, transpose(routes.matrix), wire_dtype)
    shape = (local * groups.size, rows, model_dim)
    return scatter_rows(returned_NM, to_device(routes.sent_N, y_LXM.device), shape)
