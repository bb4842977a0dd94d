"""Tutel's zero-cost switchable parallelism (§3.1): every r runs on one storage layout.

Storage (fixed, whatever r runs): with W <= E each rank holds E / W whole experts
(:meth:`ExpertPlacement.expert_parallel`); with W > E (W a multiple of E) rank i holds hidden slice
i mod S of expert i // S, S = W / E (:meth:`ExpertPlacement.hidden_sharded`). Switching r between
iterations therefore moves no weight and touches no optimizer state; only transient gathered
copies and the token routing change:

- r = 0 (switchable DP, Fig. 6): the weights of all E experts are all-gathered over the W ranks
  (ZeRO-3), every rank runs them on its own tokens, nothing is sent; the backward reduce-scatters
  the weight gradients, so each stored slice gets the sum over every rank's tokens.
- r >= 1 (switchable EP+DP+MP, Fig. 7): each rank repeats its (E, C, M) buffer r times and views
  it as (W, C / g, M), g = S / r: rank e * S + j * g + p receives capacity part p of every rank's
  slots of expert e, for hidden block j (units [j H / r, (j + 1) H / r)), which the g ranks of its
  block all-gather from their stored slices. The combine returns the r blocks' partial outputs
  and sums them locally. r = 1 is EP+DP, r = S is EP+MP (Parm's fused EP&ESP exchange).

The output bias b2 is whole on every shard and added by the shard that starts at hidden 0 (the
placement's rule); under a gather, the block that holds hidden 0 takes it from its first rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeflow.comm.algorithms import exchange
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.wire import from_wire, to_wire
from moeflow.comm.zero import gather_shards
from moeflow.config import EXACT_WIRE, check_switchable_layout, validate_r
from moeflow.core.experts import FFNWeights
from moeflow.core.stats import PipelineTiming, region_clock
from moeflow.parallel.chunk_pipeline import (
    ChunkExchange,
    ExpertExchange,
    SelfAdjointExchange,
    pad_slots,
    padded_slots,
    pipelined_experts,
)
from moeflow.parallel.context import RunContext, ScheduleOutput
from moeflow.parallel.modelled import ModelledSchedule
from moeflow.parallel.placement import ExpertPlacement
from moeflow.perf.schedule_models import LOCAL, AdaptiveModel, Plan


def switchable_placement(num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
    """The one storage layout of every r (Tutel's ZeRO-style unique slices)."""
    if world_size > num_experts:
        return ExpertPlacement.hidden_sharded(num_experts, world_size, hidden_dim)
    return ExpertPlacement.expert_parallel(num_experts, world_size, hidden_dim)


def gather_weights(
    weights: FFNWeights, group: torch.distributed.ProcessGroup | None, parts: int, timing: PipelineTiming | None = None
) -> FFNWeights:
    """All-gather every rank's stored slices over ``group`` and join each run of ``parts``
    consecutive ranks' hidden slices into one expert (or hidden block); differentiable: the
    backward reduce-scatters the gradients onto the stored slices. b2 of a joined expert is its
    first rank's (the one whose slice starts the block). ``timing`` gets the seconds of the
    gathers (forward) and of the reduce-scatters (backward): they are part of the layer's time."""
    if group is None:
        return weights

    def join(tensor: torch.Tensor | None, hidden_axis: int | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        gathered = gather_shards(tensor, group, timing)  # (N, ...) in group rank order
        blocks = gathered.shape[0] // parts
        if hidden_axis is None:  # b2 (N, M): the block's first rank
            return gathered.view(blocks, parts, -1)[:, 0]
        if hidden_axis == 1:  # b1 (N, Hs), w2 (N, Hs, M): slices are contiguous along the hidden axis
            return gathered.reshape(blocks, parts * gathered.shape[1], *gathered.shape[2:])
        model_dim, width = gathered.shape[1], gathered.shape[2]  # w1, w3 (N, M, Hs)
        return gathered.view(blocks, parts, model_dim, width).transpose(1, 2).reshape(blocks, model_dim, parts * width)

    start = region_clock(timing)
    joined = FFNWeights(
        join(weights.w1, 2), join(weights.b1, 1), join(weights.w2, 1), join(weights.b2, None), join(weights.w3, 2),
        join(weights.b3, 1),
    )
    if timing is not None:
        timing.gather_s += region_clock(timing) - start
    return joined


@dataclass(frozen=True)
class SwitchableExchange(SelfAdjointExchange):
    """The exchange of r >= 1 with W > E: (E, Cj, M) chunks by destination expert <-> the (1, W * Cj / g,
    M) rows of this rank's hidden block. Dispatch = all-to-all after an r-fold repeat; combine = the
    same all-to-all, then the local sum over the r blocks: the two are each other's adjoint, as the
    pipeline's backward needs. A chunk whose slots do not split over g ranks is padded with empty
    slots (the padding is dropped again in the combine, and its gradient is zero)."""

    groups: ParallelGroups
    algorithm: str
    r: int
    group: int  # g = S / r: ranks that share one hidden block of one expert
    wire_dtype: str = EXACT_WIRE  # how the rows travel (moeflow.comm.wire)

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        chunk_ECM = pad_slots(chunk_ECM, self.group)
        model_dim = chunk_ECM.shape[-1]
        with torch.no_grad():
            sent = to_wire(self.wire_dtype, chunk_ECM)  # once, before the r-fold repeat
        experts, padded, width = sent.shape
        part = padded // self.group
        repeated = (
            sent.view(experts, 1, self.group, part, width)
            .expand(experts, self.r, self.group, part, width)
            .reshape(self.groups.size, part, width)
        )
        received = exchange(self.algorithm, repeated, self.groups)  # (W, Cj / g, wire row) by source
        return from_wire(self.wire_dtype, received, chunk_ECM.dtype).view(1, self.groups.size * part, model_dim)

    def from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        world, model_dim = self.groups.size, y_LXM.shape[-1]
        padded = padded_slots(rows, self.group)
        returned = exchange(self.algorithm, y_LXM.view(world, padded // self.group, model_dim), self.groups,
                            wire_dtype=self.wire_dtype)
        summed = returned.view(world // (self.r * self.group), self.r, padded, model_dim).sum(dim=1)
        return summed if padded == rows else summed[:, :rows]


@dataclass(frozen=True)
class AdaptiveSchedule(ModelledSchedule):
    """Tutel's switchable parallelism as one schedule: the planner picks r per iteration (with the
    pipeline degree and the all-to-all algorithm), or ``r`` fixes it."""

    r: int | None = None
    name: str = "adaptive"
    takes_r = True

    @property
    def model(self) -> AdaptiveModel:
        return AdaptiveModel(self.name, self.r)

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        check_switchable_layout(num_experts, world_size, hidden_dim)
        if self.r is not None:
            validate_r(self.r, num_experts, world_size)
        return switchable_placement(num_experts, world_size, hidden_dim)

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        """r = 0 gathers every expert and keeps the tokens; r >= 1 moves tokens within blocks of
        ranks that gather their hidden shards (the padded kernel: its experts are sharded)."""
        groups, timing, workspace, experts = ctx.groups, ctx.timing, ctx.workspace, ctx.experts
        num_experts, world = dispatched_ECM.shape[0], groups.size
        r = validate_r(1 if plan.r is None else plan.r, num_experts, world)
        shards = world // num_experts if world > num_experts else 1
        stored = ctx.weights()
        if r == 0:  # every expert, gathered from all ranks; tokens stay
            weights = gather_weights(stored, groups.expert if world > 1 else None, shards, timing)
            compute = dataclasses.replace(experts.compute, adds_output_bias=True)
            chunk_exchange: ChunkExchange = ExpertExchange(None, LOCAL, num_experts)
        elif shards == 1:  # W <= E, r = 1: plain expert parallelism
            weights, compute = stored, experts.compute
            chunk_exchange = ExpertExchange(groups, plan.algorithm, experts.num_experts, ctx.wire_dtype)
        else:
            group = shards // r
            weights = gather_weights(stored, groups.block(group), group, timing)
            first_of_block = (groups.rank % shards) // group * group == 0  # its block starts at hidden 0
            compute = dataclasses.replace(experts.compute, adds_output_bias=first_of_block)
            chunk_exchange = SwitchableExchange(groups, plan.algorithm, r, group, ctx.wire_dtype)
        combined_ECM = pipelined_experts(
            dispatched_ECM, compute, weights, chunk_exchange, plan.degree, timing, workspace
        )
        return ScheduleOutput(combined_ECM)
