"""Parallel schedules: how a dispatched (E, C, M) buffer becomes the combined one.

A schedule owns a placement rule (where the expert weights live), the model half (candidate plans
and their predicted cost, :mod:`moeflow.perf.schedule_models`) and ``run``. ``MoELayer.forward`` calls
``schedule.run`` between encode and decode; a new technique is a new schedule, not a new path
through the layer.

- :class:`ExpertParallelSchedule`: experts split over the group; tokens travel by all-to-all,
  pipelined over capacity chunks with the planned algorithm, or over FasterMoE's pairwise steps
  (a smart plan, :mod:`moeflow.parallel.smart`).
- :class:`ReplicatedSchedule`: every rank holds every expert and runs them on its own tokens; no
  all-to-all. Its expert gradients are those of the rank's own tokens, summed by the trainer's
  gradient all-reduce like any replicated parameter.
- :class:`PackedSchedule`: Lina's expert packing, expert parallelism inside blocks of ranks that
  each hold every expert (set by the trainer's packer, not chosen at build time).
- :class:`~moeflow.parallel.adaptive.AdaptiveSchedule`: Tutel's switchable parallelism, r chosen per
  iteration on one sharded storage layout (r = 0 gathers the weights instead of moving tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import cross_node_rows
from moeflow.config import DEDUP, PADDED, ragged_min_saving
from moeflow.core.experts import ExpertCompute
from moeflow.core.stats import PipelineTiming
from moeflow.parallel.chunk_pipeline import ChunkExchange, ExpertExchange, pipelined_experts
from moeflow.parallel.context import Prepared, RunContext, ScheduleOutput
from moeflow.parallel.dedup_exchange import DedupExchange
from moeflow.parallel.direct_path import DirectPath
from moeflow.parallel.inference_hook import InferenceHook
from moeflow.parallel.modelled import ModelledSchedule
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.ragged_exchange import RaggedExpertExchange
from moeflow.parallel.smart import smart_experts
from moeflow.parallel.token_share import TokenShare
from moeflow.perf import CostModel
from moeflow.perf.pipeline import PlanPrediction, capacity_chunks
from moeflow.perf.schedule_models import LOCAL, SMART, ExpertParallelModel, Plan, ReplicatedModel, ScheduleModel
from moeflow.perf.shape import RegionShape


class ParallelSchedule(Protocol):
    """How a dispatched buffer becomes the combined one. Everything a run needs is in its
    :class:`~moeflow.parallel.context.RunContext`; the defaults of the optional members are
    :class:`~moeflow.parallel.modelled.ModelledSchedule`'s."""

    name: str
    takes_ragged: bool  # run() uses the ragged kernel where the layer asks for it
    takes_r: bool  # a call's r (Tutel's adaptive_r) selects its plan

    @property
    def model(self) -> ScheduleModel:
        """The model half: candidates and their predicted cost (what the planner ranks)."""
        ...

    @property
    def hook(self) -> InferenceHook | None: ...

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement: ...

    def direct_path(self, placement: ExpertPlacement, rank: int) -> DirectPath | None:
        """How a small no-grad forward of ``rank`` may skip the capacity buffer: ``LOCAL`` on its own
        experts (:mod:`moeflow.parallel.dispatchers.local`), ``EXCHANGE`` with each expert's one holder
        (gathered or exchanged rows, :mod:`moeflow.parallel.dispatchers.choice`), or None (the capacity
        dispatcher). Asked once per placement, when the layer is built and on ``switch()``."""
        ...

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]: ...

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction: ...

    def token_share(
        self, plan: Plan, groups: ParallelGroups, num_experts: int, timing: PipelineTiming
    ) -> TokenShare:
        """Which routed tokens this rank encodes, sends and decodes under ``plan``."""
        ...

    def plan_label(self, plan: Plan) -> str: ...

    def plan_space(
        self, degree_policy: int | str, algorithms: tuple[str, ...], cost_model: CostModel | None
    ) -> tuple[int | str, tuple[str, ...], CostModel | None]: ...

    def prepare(self, capacity: int, filled_WE: torch.Tensor, placement: ExpertPlacement, rank: int) -> Prepared:
        """Once per forward, before the plan: the capacity the planner prices, and what ``run``
        needs again of the same derivation (handed back in ``ctx.prepared``)."""
        ...

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput: ...


@dataclass(frozen=True)
class _ModelledSchedule(ModelledSchedule):
    """A schedule run by the capacity-chunk pipeline over its own exchange."""

    name: str

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        """The pipelined experts, with this schedule's way of moving chunks and its kernel."""
        return ScheduleOutput(self.pipelined(plan, dispatched_ECM, self.exchange(plan, ctx), ctx))

    def pipelined(
        self, plan: Plan, dispatched_ECM: torch.Tensor, chunk_exchange: ChunkExchange, ctx: RunContext,
        scale_LWC: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return pipelined_experts(
            dispatched_ECM, self.compute(ctx), ctx.weights(), chunk_exchange, plan.degree, ctx.timing, ctx.workspace,
            scale_LWC,
        )

    def exchange(self, plan: Plan, ctx: RunContext) -> ChunkExchange:
        raise NotImplementedError

    def compute(self, ctx: RunContext) -> ExpertCompute:
        """The local experts on the slots every rank of the group sends them."""
        return ctx.received_compute(0, ctx.world_size)


@dataclass(frozen=True)
class ExpertParallelSchedule(_ModelledSchedule):
    """Expert parallelism: each rank holds E/W whole experts and tokens travel to them by
    all-to-all."""

    name: str = "expert"
    token_exchange: str = PADDED  # padded, ragged or auto (moeflow.config.TOKEN_EXCHANGE_CHOICES)
    dedup_candidate: bool = False  # under auto, dedup plans are candidates too (priced by the cost model)
    takes_ragged = True

    @property
    def model(self) -> ScheduleModel:
        return ExpertParallelModel(exchange=self.token_exchange, dedup_candidate=self.dedup_candidate)

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return ExpertPlacement.expert_parallel(num_experts, world_size, hidden_dim)

    def direct_path(self, placement: ExpertPlacement, rank: int) -> DirectPath | None:
        """Its own placement (each expert whole on one rank) exchanges the rows directly."""
        local = super().direct_path(placement, rank)
        if local is not None or self.hook is not None or not placement.is_expert_parallel:
            return local
        return DirectPath.EXCHANGE

    def exchange(self, plan: Plan, ctx: RunContext) -> ChunkExchange:
        """An all-to-all over the group: of every slot, or of the kept rows only (a ragged plan; under
        ``auto``, of the chunks that leave enough slots empty), or of the kept rows with a token sent
        once to each rank (a dedup plan: it reads which token each slot holds)."""
        if plan.exchange == DEDUP and ctx.world_size > 1:
            if ctx.slots is None or ctx.weights_TK is None:
                raise ValueError("token_exchange='dedup' needs the dispatched buffer's slot map and gate weights "
                                 "(ctx.slots, ctx.weights_TK)")
            chunks = capacity_chunks(ctx.capacity, plan.degree)
            return DedupExchange.build(ctx.groups, plan.algorithm, ctx.filled_WE, ctx.slots.slot_token_S, chunks,
                                       ctx.wire_dtype)
        if plan.exchange != PADDED and ctx.world_size > 1:
            return RaggedExpertExchange(ctx.groups, plan.algorithm, ctx.filled_WE,
                                        min_saving=ragged_min_saving(plan.exchange), wire_dtype=ctx.wire_dtype)
        return ExpertExchange(ctx.groups, plan.algorithm, ctx.experts.num_experts, ctx.wire_dtype)

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        """The capacity-chunk pipeline, or FasterMoE's pairwise steps for a smart plan; reports
        the assignments each rank's experts compute (their owners')."""
        dedup: DedupExchange | None = None
        if plan.schedule != SMART:
            chunk_exchange = self.exchange(plan, ctx)
            dedup = chunk_exchange if isinstance(chunk_exchange, DedupExchange) else None
            scale_LWC = dedup.gate_weights(ctx.slot_weights()) if dedup is not None else None  # where experts run
            combined_ECM = self.pipelined(plan, dispatched_ECM, chunk_exchange, ctx, scale_LWC)
        else:
            combined_ECM = smart_experts(
                dispatched_ECM, self.compute(ctx), ctx.weights(), ctx.groups, ctx.timing, ctx.workspace,
                ctx.wire_dtype,
            )
        # rank r's experts are the buffer's r-th run of columns: they compute what every rank sends there
        rank_tokens = ctx.filled_WE.sum(0).view(ctx.world_size, -1).sum(1)
        ragged = plan.exchange != PADDED and plan.schedule != SMART
        if dedup is not None:  # what travelled: one row per (token, rank), weighted
            return ScheduleOutput(combined_ECM, tuple(rank_tokens.tolist()), dedup_totals=dedup.totals, weighted=True)
        crossed = cross_node_rows(ctx.filled_WE, dispatched_ECM.shape[1], ragged, ctx.groups.topology)
        return ScheduleOutput(combined_ECM, tuple(rank_tokens.tolist()), cross_node_rows=crossed)


@dataclass(frozen=True)
class ReplicatedSchedule(_ModelledSchedule):
    """Every rank holds every expert: tokens stay on their rank and no all-to-all runs."""

    name: str = "replicated"
    takes_ragged = True

    @property
    def model(self) -> ScheduleModel:
        return ReplicatedModel()

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return ExpertPlacement.replicated(num_experts, world_size, hidden_dim)

    def exchange(self, plan: Plan, ctx: RunContext) -> ExpertExchange:
        return ExpertExchange(None, LOCAL, ctx.experts.num_experts)  # tokens stay: only the chunking

    def compute(self, ctx: RunContext) -> ExpertCompute:
        return ctx.own_compute(ctx.local)  # every expert, on this rank's own tokens


@dataclass(frozen=True)
class PackedSchedule(_ModelledSchedule):
    """Lina's expert packing (§4.2): expert parallelism inside each block of ``group_size``
    consecutive ranks, every block holding all experts (:meth:`ExpertPlacement.packed`). Tokens
    travel by all-to-all within the block only; the blocks' copies of an expert average their
    gradients like a replicated weight. The planner prices it as an expert-parallel exchange."""

    name: str = "packed"
    group_size: int = 1
    takes_ragged = True

    @property
    def model(self) -> ScheduleModel:
        return ExpertParallelModel()  # priced as an expert-parallel exchange

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        return ExpertPlacement.packed(num_experts, world_size, self.group_size, hidden_dim)

    def exchange(self, plan: Plan, ctx: RunContext) -> ExpertExchange:
        return ExpertExchange(ctx.groups.packed(self.group_size), plan.algorithm, ctx.experts.num_experts,
                              ctx.wire_dtype)

    def compute(self, ctx: RunContext) -> ExpertCompute:
        return ctx.received_compute(ctx.rank // self.group_size * self.group_size, self.group_size)

    def plan_label(self, plan: Plan) -> str:
        return self.name

    def plan_space(
        self, degree_policy: int | str, algorithms: tuple[str, ...], cost_model: CostModel | None
    ) -> tuple[int | str, tuple[str, ...], CostModel | None]:
        """A block's all-to-all runs on a subgroup: the linear one."""
        return degree_policy, ("linear",), cost_model


def packed_schedule(group_size: int, world_size: int) -> ParallelSchedule:
    """The schedule of blocks of ``group_size`` ranks: expert parallelism itself when the block is
    the whole group."""
    return ExpertParallelSchedule() if group_size == world_size else PackedSchedule(group_size=group_size)
