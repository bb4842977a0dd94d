"""moeflow as an expert-parallel backend inside transformers: ``ep_implementation="moeflow"``.

transformers (5.24) runs expert parallelism itself: ``from_pretrained(path, distributed_config=
DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation=...))`` shards each MoE block's experts
over the expert-parallel ranks and hands the block's routed batch (``hidden_states``,
``top_k_index`` with global expert ids, ``top_k_weights``) to the ``EPImplementation`` that
``ep_implementation`` names. ``import moeflow.hf`` registers ``"moeflow"`` there; the model's router
and experts, their weights and their ``experts_implementation`` stay the model's own.

What travels (``token_exchange``):

- ``auto`` (the default): ``dedup`` for a batch of at least :data:`DEDUP_MIN_PAIRS` routed (token,
  expert) pairs, ``pairs`` below (decode sizes, where the bytes saved are nil and laying out the
  deduplicated rows costs more host time: 75 against 25 µs a call on the development VM). Each
  rank decides for its own batch; the receivers take either;
- ``dedup`` (DeepEP's dispatch): a token crosses to each rank once, whatever number of
  its k experts that rank holds. It arrives with the local ids and gate weights of its experts there
  (the other slots off-rank: id ``num_local_experts``, weight 0, which every transformers experts
  implementation skips), the rank's experts return one weighted sum per token, and the sender adds
  the ranks' sums. Rows each way: the distinct (token, rank) pairs, at most T * min(k, W).
- ``pairs``: one row per (token, expert) pair, as transformers' own ``all_to_all`` sends.

How: the all-to-all algorithm moeflow runs (``linear``, Tutel's ``2dh``, FasterMoE's ``pairwise``;
:mod:`moeflow.comm.algorithms`), the rows in the wire format asked for both ways and in the backward
(``exact``, ``bf16``, ``fp8``; :mod:`moeflow.comm.wire`), the gate weights always exact, and in
``pipeline`` chunks whose exchanges overlap the experts (:mod:`moeflow.hf.pipelined`; ``auto``, the
default: each block searches its degree per batch size, :mod:`moeflow.hf.degree_search`). Settings
come from one call, :func:`configure`, which registers the backend again with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from moeflow.comm.algorithms import SplitMatrix, differentiable_exchange, transpose
from moeflow.comm.collectives import all_gather_into
from moeflow.comm.groups import ParallelGroups, group_rank, group_size, max_over_ranks
from moeflow.comm.mp import gather_rows, member_rows, split_rows
from moeflow.comm.topology import Topology
from moeflow.config import (
    ALLTOALL_ALGORITHMS,
    DEDUP,
    EXACT_WIRE,
    HF_EP_TOKEN_EXCHANGES,
    PAIRS,
    WIRE_DTYPES,
    require_choice,
)
from moeflow.core.stats import ExecutionPlan, RoutingStats
from moeflow.hf.degree_search import CANDIDATES, DegreeSearch, Key
from moeflow.hf.monitored import BackendBlock, routing_stats
from moeflow.hf.pipelined import ChunkPlan, pipelined
from moeflow.metrics.blocks import WATCH_ATTRIBUTE, WatchedBlock
from moeflow.moe.forward_memory import recomputing
from moeflow.timing.measure import sample_seconds

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

NAME = "moeflow"
"""The ``ep_implementation`` name moeflow registers in transformers."""
AUTO = HF_EP_TOKEN_EXCHANGES[0]
"""Each rank's batch sent deduplicated or as pairs by its size (:data:`DEDUP_MIN_PAIRS`)."""
DEDUP_MIN_PAIRS = 256
"""Under ``auto``, the routed (token, expert) pairs from which a batch is sent deduplicated."""
PIPELINE_MIN_ROWS = 64
"""The rows a rank sends per chunk at least: a batch of fewer (a decoding step) moves in one piece."""


@dataclass(frozen=True)
class BackendSettings:
    """How the backend moves tokens; see the module's docstring. ``topology``: the world's ranks on
    nodes, which ``2dh`` and ``pairwise`` need (None: all ranks on one node)."""

    token_exchange: str = AUTO
    alltoall: str = "linear"
    wire_dtype: str = EXACT_WIRE
    topology: Topology | None = None
    pipeline: int | str = "auto"  # the chunks a block's rows move and compute in, or "auto" (searched)

    def __post_init__(self) -> None:
        number = isinstance(self.pipeline, int) and not isinstance(self.pipeline, bool) and self.pipeline >= 1
        if not (number or self.pipeline == "auto"):
            raise ValueError(f"pipeline must be 'auto' or a number of chunks >= 1, got {self.pipeline!r}")
        require_choice("token_exchange", self.token_exchange, HF_EP_TOKEN_EXCHANGES)
        require_choice("alltoall", self.alltoall, ALLTOALL_ALGORITHMS)
        require_choice("wire_dtype", self.wire_dtype, WIRE_DTYPES)


@dataclass(frozen=True)
class Routes:
    """The rows this rank sends, by destination rank: the token each carries, the local expert ids
    and gate weights it takes there (the valid slots first, the rest off-rank with weight 0), and
    how many rows go to each rank."""

    token_N: torch.Tensor
    ids_NK: torch.Tensor
    weights_NK: torch.Tensor
    sizes_W: torch.Tensor
    width: int  # the expert slots a row needs: the most valid ones of any row (at least one)

    def slots(self, width: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids and weights cut or padded (off-rank, weight 0) to ``width`` slots: the group's
        widest row's, which a rank sending pairs (one slot) may be under."""
        ids_NK, weights_NK = self.ids_NK[:, :width], self.weights_NK[:, :width]
        missing = width - ids_NK.shape[1]
        if missing > 0:
            ids_NK = torch.nn.functional.pad(ids_NK, (0, missing), value=num_local)
            weights_NK = torch.nn.functional.pad(weights_NK, (0, missing))
        return ids_NK, weights_NK


def dedup_routes(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_local: int, world: int) -> Routes:
    """One row per (token, rank holding one of its experts), by rank then token."""
    owner_TK = torch.div(top_k_index, num_local, rounding_mode="floor")
    sent_WT = torch.zeros(world, top_k_index.shape[0], dtype=torch.bool, device=top_k_index.device)
    sent_WT.scatter_(0, owner_TK.T, True)
    rank_N, token_N = sent_WT.nonzero(as_tuple=True)  # row-major: by rank, then token
    here_NK = owner_TK[token_N] == rank_N.unsqueeze(1)
    valid_first = torch.argsort((~here_NK).to(torch.int8), dim=1, stable=True)
    here_NK = here_NK.gather(1, valid_first)
    ids_NK = torch.where(here_NK, (top_k_index[token_N] % num_local).gather(1, valid_first), num_local)
    weights_NK = torch.where(here_NK, top_k_weights[token_N].gather(1, valid_first), 0.0)
    width = int(here_NK.sum(1).max()) if len(token_N) else 1
    return Routes(token_N, ids_NK, weights_NK, sent_WT.sum(1), width)


def pair_routes(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_local: int, world: int) -> Routes:
    """One row per (token, expert) pair, by expert (so by rank)."""
    expert_S = top_k_index.reshape(-1)
    order = torch.argsort(expert_S, stable=True)
    owner_S = torch.div(expert_S, num_local, rounding_mode="floor")
    sizes_W = torch.bincount(owner_S, minlength=world)
    top_k = top_k_index.shape[1]
    return Routes(order // top_k, (expert_S[order] % num_local).unsqueeze(1),
                  top_k_weights.reshape(-1)[order].unsqueeze(1), sizes_W, 1)


ROUTES = {DEDUP: dedup_routes, PAIRS: pair_routes}
"""How ``dedup`` and ``pairs`` lay out the rows they send."""


def exchange_for(token_exchange: str, top_k_index: torch.Tensor) -> str:
    """The exchange a batch travels by (:data:`ROUTES` lays out its rows): ``token_exchange``, or
    under ``auto`` by its routed pairs."""
    if token_exchange == AUTO:
        return DEDUP if top_k_index.numel() >= DEDUP_MIN_PAIRS else PAIRS
    return token_exchange


@dataclass
class Backend:
    """One configuration of the backend and the moeflow groups it made for each expert-parallel
    group (made once per group, in the order transformers builds the blocks: the same on every rank)."""

    settings: BackendSettings
    groups: dict[dist.ProcessGroup, ParallelGroups] = field(default_factory=dict)
    searches: list[DegreeSearch] = field(default_factory=list)  # pipeline="auto": each block's, in build order

    def groups_of(self, group: dist.ProcessGroup) -> ParallelGroups:
        if group not in self.groups:
            subgroups = {} if self.settings.alltoall == "linear" else None  # 2DH's node groups, made up front
            self.groups[group] = ParallelGroups(group, self.settings.topology, subgroups=subgroups)
        return self.groups[group]


class MoeflowEP(EPImplementation):
    """The rows of one MoE block to the ranks of their experts and back, as its :class:`Backend` says
    (:func:`configure` registers a subclass that carries one). ``last_stats``: the last forward's
    routing over the expert group (counts per expert, the exchange and chunks that ran), which
    :class:`~moeflow.metrics.MoEMonitor` reads; ``index``: the block's number there."""

    backend: Backend
    last_stats: RoutingStats | None = None
    index: int | None = None

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
        super().__init__(experts, ep_mesh, tp_mesh)
        self.expert_module = experts  # its parameters: inputs of the pipelined chunks' graph
        self.groups = self.backend.groups_of(ep_mesh.get_group())
        self.shared_batch = tp_mesh.get_group() if tp_mesh.size() > 1 else None  # the ranks that share a batch
        self.search = DegreeSearch() if self.backend.settings.pipeline == "auto" else None
        if self.search is not None:
            self.backend.searches.append(self.search)
        setattr(experts, WATCH_ATTRIBUTE, self.watched)

    def watched(self, block: nn.Module) -> WatchedBlock:
        """This block as :class:`~moeflow.metrics.MoEMonitor` reads it (``block``: the MoE block
        that holds the experts, and their router)."""
        return BackendBlock(self, block)

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Under tensor parallelism the ranks of a group share one batch: each moves its rows of it
        (Megatron's split; its backward gathers the rows' gradients) and the outputs are gathered
        back, so no token reaches an expert twice."""
        group = self.shared_batch
        if group is None:
            return self._moved(hidden_states, top_k_index, top_k_weights)
        start, stop = member_rows(len(hidden_states), group_size(group), group_rank(group))
        hidden_states, top_k_weights = split_rows(hidden_states, group), split_rows(top_k_weights, group)
        rows = self._moved(hidden_states, top_k_index[start:stop], top_k_weights)
        with self.groups.ledger.tracked("all-gather", group, rows.numel() * rows.element_size()):
            return gather_rows(rows, len(top_k_index), group)

    def _moved(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Each token's weighted expert output: its rows to the experts' ranks and back."""
        settings, world = self.backend.settings, self.groups.size
        exchange = exchange_for(settings.token_exchange, top_k_index)
        routes = ROUTES[exchange](top_k_index, top_k_weights, self.num_local_experts, world)
        largest = max(CANDIDATES) if self.search is not None else int(settings.pipeline)
        with self.groups.ledger.at(layer=self.index, direction="forward"):
            matrix, width, offered, counts = self._agree(routes, largest, top_k_index)
            output, degree, source = self._searched(hidden_states, routes, matrix, width, offered)
        if not recomputing():  # activation checkpointing's recompute is the same forward again
            self.last_stats = routing_stats(counts, top_k_index.shape[1], self._plan(exchange, degree, offered, source))
        return output

    def _searched(
        self, hidden_states: torch.Tensor, routes: Routes, matrix: SplitMatrix, width: int, offered: int
    ) -> tuple[torch.Tensor, int, str]:
        """:meth:`_run` in the chunks set, or the search's (which it times while it searches); the
        chunks that ran and whence they came."""
        if self.search is None:
            return self._run(hidden_states, routes, matrix, width, offered), offered, "forced"
        key = DegreeSearch.key(sum(map(sum, matrix)), offered)
        if torch._C._current_autograd_node() is not None:  # activation checkpointing's recompute: as it ran
            degree = self.search.as_ran(key)
            return self._run(hidden_states, routes, matrix, width, degree), degree, "settled"
        degree, timed = self.search.next(key)
        if timed:
            output = self._timed(hidden_states, routes, matrix, width, degree, key)
        else:
            output = self._run(hidden_states, routes, matrix, width, degree)
        if output.requires_grad:
            self._await_backward(key, output)
        return output, degree, "trial" if timed else "settled"

    def _plan(self, exchange: str, degree: int, offered: int, source: str) -> ExecutionPlan:
        """How the forward ran, in the terms of a moeflow layer's plan."""
        settings = self.backend.settings
        return ExecutionPlan(schedule="pipelined" if degree > 1 else "sequential", alltoall=settings.alltoall,
                             pipeline_degree=degree, requested_degree=offered, policy=str(settings.pipeline),
                             source=source, world_size=self.groups.size, expert_kernel="transformers",
                             token_exchange=exchange)

    def _timed(
        self, hidden_states: torch.Tensor, routes: Routes, matrix: SplitMatrix, width: int, degree: int,
        key: Key,
    ) -> torch.Tensor:
        """:meth:`_run`, its slowest rank's time recorded in the search (one all-reduce)."""
        out: list[torch.Tensor] = []
        seconds = sample_seconds(lambda: out.append(self._run(hidden_states, routes, matrix, width, degree)),
                                 hidden_states.device)
        (slowest,) = max_over_ranks([seconds], self.groups.expert, self.groups.ledger)
        assert self.search is not None
        self.search.record(key, degree, slowest)
        return out[0]

    def _await_backward(self, key: Key, output: torch.Tensor) -> None:
        """Count ``output``'s graph in the search until its backward reaches it (two forwards before one
        backward, as a preference loss takes, then run one degree: :class:`DegreeSearch`)."""
        assert self.search is not None
        search = self.search
        search.built(key)

        def reached(grad: torch.Tensor) -> torch.Tensor:
            search.reached(key)
            return grad

        output.register_hook(reached)

    def _run(
        self, hidden_states: torch.Tensor, routes: Routes, matrix: SplitMatrix, width: int, degree: int
    ) -> torch.Tensor:
        """The rows to the experts and back in ``degree`` chunks (one piece at 1)."""
        settings = self.backend.settings
        if degree > 1:
            ids_NK, weights_NK = routes.slots(width, self.num_local_experts)
            plan = ChunkPlan.of(matrix, degree, settings.alltoall, settings.wire_dtype, self.groups,
                                self._packs(hidden_states.dtype, weights_NK.dtype))
            back_NM = pipelined(hidden_states[routes.token_N], ids_NK, weights_NK, plan, self._experts,
                                tuple(self.expert_module.parameters()))
        else:
            rows_NM, ids_NK, weights_NK = self._dispatch(hidden_states, routes, matrix, width)
            expert_NM = self._experts(rows_NM, ids_NK, weights_NK)
            back_NM = differentiable_exchange(settings.alltoall, expert_NM, self.groups, transpose(matrix),
                                              settings.wire_dtype)
        return hidden_states.new_zeros(hidden_states.shape).index_add(0, routes.token_N, back_NM)

    def _packs(self, dtype: torch.dtype, weights_dtype: torch.dtype) -> bool:
        """Whether the ids and gate weights ride exactly as extra columns of the rows: exact wire, the
        weights in the rows' dtype, the ids below the dtype's largest exact integer."""
        exact_ints = round(2 / torch.finfo(dtype).eps) if dtype.is_floating_point else 0  # 2 ** (mantissa + 1)
        return (self.backend.settings.wire_dtype == EXACT_WIRE and weights_dtype == dtype
                and self.num_local_experts < exact_ints)

    def _dispatch(
        self, hidden_states: torch.Tensor, routes: Routes, matrix: SplitMatrix, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows, their local expert ids and gate weights at their ranks. The ids and weights ride
        as extra columns of the rows where that is exact (exact wire, the weights in the rows' dtype,
        the ids below its largest exact integer): one all-to-all instead of two."""
        algorithm, wire, dtype = self.backend.settings.alltoall, self.backend.settings.wire_dtype, hidden_states.dtype
        rows_NM = hidden_states[routes.token_N]
        ids_NK, weights_NK = routes.slots(width, self.num_local_experts)
        if self._packs(dtype, weights_NK.dtype):
            packed = torch.cat([rows_NM, ids_NK.to(dtype), weights_NK], dim=1)
            packed = differentiable_exchange(algorithm, packed, self.groups, matrix)
            model_dim = rows_NM.shape[1]
            return (packed[:, :model_dim], packed[:, model_dim:model_dim + width].detach().round().long(),
                    packed[:, model_dim + width:])
        rows_NM = differentiable_exchange(algorithm, rows_NM, self.groups, matrix, wire)
        slots_NK = torch.cat([ids_NK.float(), weights_NK.float()], dim=1)
        slots_NK = differentiable_exchange(algorithm, slots_NK, self.groups, matrix)  # the gate weights exact
        return rows_NM, slots_NK[:, :width].detach().round().long(), slots_NK[:, width:].to(dtype)

    def _agree(
        self, routes: Routes, pipeline: int, top_k_index: torch.Tensor
    ) -> tuple[SplitMatrix, int, int, list[int]]:
        """Every rank's rows to every rank, the widest row's expert slots, the chunks all ranks'
        batches fill (each rank offers up to ``pipeline``, :data:`PIPELINE_MIN_ROWS` rows a chunk;
        the fewest offered runs) and the group's (token, expert) pairs per expert: one all-gather."""
        group, world = self.groups.expert, self.groups.size
        offered = max(1, min(pipeline, len(routes.token_N) // PIPELINE_MIN_ROWS))
        experts = self.num_local_experts * world
        counts_E = torch.bincount(top_k_index.reshape(-1), minlength=experts).to(routes.sizes_W)
        mine = torch.cat([routes.sizes_W, routes.sizes_W.new_tensor([routes.width, offered]), counts_E])
        every = mine.new_empty(world * len(mine))
        with self.groups.ledger.tracked("all-gather", group, every.numel() * every.element_size()):
            all_gather_into(every, mine, group)
        rows = every.view(world, len(mine))
        table, counts = rows[:, : world + 2].tolist(), rows[:, world + 2 :].sum(0).tolist()
        return ([row[:world] for row in table], max(row[world] for row in table), min(row[world + 1] for row in table),
                counts)

    def _experts(self, rows_NM: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received, one weighted sum per row. A row of several
        slots runs as its valid (row, expert) pairs, summed back per row: the experts implementations
        gather, mask and weigh every slot they are given, the off-rank ones too. None received still
        runs the experts on one zero row, so they stay in the graph (FSDP's gradient reduction runs on
        every rank)."""
        if not rows_NM.shape[0]:
            zero = rows_NM.sum(0, keepdim=True)
            return self.experts_forward(zero, ids_NK.new_zeros((1, 1)), weights_NK.new_ones((1, 1)))[:0]
        if ids_NK.shape[1] == 1:
            return self.experts_forward(rows_NM, ids_NK, weights_NK)
        row_P, slot_P = (ids_NK < self.num_local_experts).nonzero(as_tuple=True)
        pairs_PM = self.experts_forward(rows_NM[row_P], ids_NK[row_P, slot_P].unsqueeze(1),
                                        weights_NK[row_P, slot_P].unsqueeze(1))
        return rows_NM.new_zeros(rows_NM.shape).index_add(0, row_P, pairs_PM)


def configure(
    token_exchange: str = AUTO, alltoall: str = "linear", wire_dtype: str = EXACT_WIRE,
    topology: Topology | None = None, pipeline: int | str = "auto",
) -> BackendSettings:
    """Register ``ep_implementation="moeflow"`` in transformers with these settings (``import
    moeflow.hf`` registers the defaults). Models loaded afterwards run with them."""
    settings = BackendSettings(token_exchange, alltoall, wire_dtype, topology, pipeline)
    configured = type(MoeflowEP.__name__, (MoeflowEP,), {"backend": Backend(settings), "__doc__": MoeflowEP.__doc__})
    EPImplementationInterface.register(NAME, configured)
    return settings


def searched_degrees() -> list[dict[Key, int]]:
    """Under ``pipeline="auto"``: each block's chosen chunk degree per batch key
    (:meth:`~moeflow.hf.degree_search.DegreeSearch.key`), in the order the blocks were built."""
    return [dict(search.chosen) for search in EPImplementationInterface()[NAME].backend.searches]
