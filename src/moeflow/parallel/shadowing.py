"""FasterMoE's dynamic shadowing (§4.1) on the expert-parallel schedule.

A shadowed expert is, for one iteration, replicated: every rank gets its weights and computes its
own tokens for it, which do not travel. The weights come from the owner through a differentiable
all-reduce (the owner contributes its parameters, the others zeros), whose backward sums every
rank's weight gradients back into the owner's parameters, which alone hold and update them: the
broadcast and reduce of the paper, as one collective each way for all shadowed weights. The forward's
is posted before the other experts' exchange and awaited only when the shadowed experts compute,
so the weights move while the tokens do; the backward's is posted after the shadowed experts'
backward and awaited after the exchanged experts' backward. The other experts run through the
schedule as usual, over the capacity that their own tokens need (a hot shadowed expert no longer
sizes the exchange); with the ragged token exchange none of a shadowed expert's tokens travel at
all.

Which experts: a fixed list, or Algorithm 1 (:func:`moeflow.perf.shadowing.select_shadowed_experts`)
on the global counts the layer already exchanges, so every rank picks the same set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from moeflow.comm.collectives import all_reduce
from moeflow.comm.groups import ParallelGroups
from moeflow.core.experts import ExpertCompute, FFNWeights
from moeflow.parallel.chunk_pipeline import ExpertExchange, pipelined_experts
from moeflow.parallel.context import RunContext, ScheduleOutput
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.wrapped import WrappingSchedule
from moeflow.perf import CostModel
from moeflow.perf.schedule_models import LOCAL, Plan
from moeflow.perf.shadowing import ShadowPrices, select_shadowed_experts, shadowed_latency


@dataclass(frozen=True)
class ShadowPlan:
    """The shadowed experts of one iteration and the capacity the exchanged experts need."""

    experts: tuple[int, ...]
    exchanged_slots: int  # the largest per-rank count of an expert not shadowed (<= capacity, >= 1)

    @staticmethod
    def of(experts: tuple[int, ...], counts_WE: torch.Tensor, capacity: int) -> ShadowPlan:
        kept = _without(experts, counts_WE.clamp(max=capacity))
        # at least one slot: every expert stays in the graph (zero gradients, not None) and every
        # rank runs the same collectives
        return ShadowPlan(experts, max(1, int(kept.max())))

    def exchanged(self, filled_WE: torch.Tensor) -> torch.Tensor:
        """The kept counts with the shadowed experts' columns zeroed: what travels to the owners."""
        return _without(self.experts, filled_WE)


def _without(experts: tuple[int, ...], counts_WE: torch.Tensor) -> torch.Tensor:
    return counts_WE.index_fill(1, torch.tensor(experts, dtype=torch.long), 0)


def check_shadowing(setting: str | tuple[int, ...], cost_model: object | None) -> None:
    """``auto`` prices its choice with a calibrated profile (which schedules shadowing runs on is
    the registry's rule)."""
    if setting == "auto" and cost_model is None:
        raise ValueError(
            "shadowing='auto' decides with FasterMoE's cost model: pass profile=<a calibrated cluster profile> "
            "(moeflow calibrate) or name the experts, shadowing=[...]"
        )


def decide_shadows(
    setting: str | tuple[int, ...], filled_WE: torch.Tensor, placement: ExpertPlacement, capacity: int,
    prices: ShadowPrices | None,
) -> tuple[ShadowPlan | None, float | None]:
    """This iteration's shadowed experts (None: none) and the predicted gain (None without prices).
    ``filled_WE``: the global routing counts after capacity, identical on every rank."""
    if setting == "off":
        return None, None
    counts = filled_WE.numpy()
    owners = [placement.holders(expert)[0] for expert in range(placement.num_experts)]
    if setting == "auto":
        assert prices is not None, "shadowing='auto' needs a cost model (the layer checks it)"
        decision = select_shadowed_experts(counts, owners, prices)
        experts, gain = decision.experts, decision.predicted_gain_s
    else:
        experts = tuple(setting)
        gain = None if prices is None else (
            shadowed_latency(counts, owners, set(), prices) - shadowed_latency(counts, owners, set(experts), prices)
        )
    return (ShadowPlan.of(experts, filled_WE, capacity) if experts else None), gain


@dataclass
class _GradientReduce:
    """The backward's gradient all-reduce in flight: posted by :class:`_SumOverRanks`, awaited by
    :class:`_AwaitGradients` (one per forward)."""

    work: dist.Work | None = None
    nbytes: int = 0


@dataclass(frozen=True)
class PendingShadows:
    """The shadowed experts' weights on their way to every rank: the owner's contribution (zeros
    elsewhere) and one all-reduce of all of them posted asynchronously, so that it moves while the
    other experts' tokens are exchanged; :meth:`wait` gives the whole weights."""

    stacked: tuple[torch.Tensor | None, ...]  # (S, ...) per weight of FFNWeights, differentiable
    reduced: torch.Tensor | None  # the flat sum being all-reduced (None: one process)
    work: dist.Work | None
    groups: ParallelGroups
    gradients: _GradientReduce

    def wait(self) -> FFNWeights:
        """The (S, ...) weights, differentiable into the owners' parameters (the backward all-reduces
        the gradients over ``groups.expert``, in its ledger)."""
        present = [t for t in self.stacked if t is not None]
        if self.reduced is None:
            return FFNWeights(*self.stacked)
        with self.groups.ledger.tracked("shadowed weight all-reduce", self.groups.expert, self.reduced.nbytes):
            if self.work is not None:
                self.work.wait()
        summed = iter(_SumOverRanks.apply(self.reduced, self.groups.expert, self.gradients, *present))
        return FFNWeights(*(None if t is None else next(summed) for t in self.stacked))


def post_shadow_weights(
    weights: FFNWeights, placement: ExpertPlacement, rank: int, experts: tuple[int, ...], groups: ParallelGroups,
) -> PendingShadows:
    """Post the all-reduce that brings the shadowed experts' whole weights, (S, ...) each, to every
    rank (the paper's broadcast from the owner; its backward is the reduce to the owner). Called
    before the other experts' exchange, so that in the backward the gradients' all-reduce, posted
    after the shadowed experts' backward, is awaited only after the exchanged experts' backward
    (autograd runs the later-made node first)."""
    local_index = {shard.expert: index for index, shard in enumerate(placement.local(rank))}

    def stack(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        parts = [tensor[local_index[e]] if e in local_index else tensor.new_zeros(tensor.shape[1:]) for e in experts]
        stacked = torch.stack(parts)
        if torch.is_grad_enabled() and not stacked.requires_grad:
            stacked.requires_grad_()  # every rank must run the backward's all-reduce, owner or not
        return stacked

    raw = [stack(tensor) for tensor in weights.as_tuple()]
    gradients = _GradientReduce()
    if groups.expert is None:
        return PendingShadows(tuple(raw), None, None, groups, gradients)
    awaited = iter(_AwaitGradients.apply(gradients, groups, *(t for t in raw if t is not None)))
    stacked = tuple(None if t is None else next(awaited) for t in raw)
    flat = torch.cat([t.detach().reshape(-1) for t in stacked if t is not None])
    return PendingShadows(stacked, flat, all_reduce(flat, groups.expert, async_op=True), groups,
                          gradients)


class _AwaitGradients(torch.autograd.Function):
    """Identity on the stacked contributions whose backward waits for the gradients' all-reduce
    that :class:`_SumOverRanks` posted (made before the exchange, it runs after the exchanged
    experts' backward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, gradients: _GradientReduce, groups: ParallelGroups, *stacked: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.gradients, ctx.groups = gradients, groups  # type: ignore[attr-defined]
        return tuple(t.view_as(t) for t in stacked)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        gradients: _GradientReduce = ctx.gradients  # type: ignore[attr-defined]
        groups: ParallelGroups = ctx.groups  # type: ignore[attr-defined]
        with groups.ledger.tracked("shadowed gradient all-reduce", groups.expert, gradients.nbytes):
            if gradients.work is not None:
                gradients.work.wait()
        return (None, None, *grads)


class _SumOverRanks(torch.autograd.Function):
    """The all-reduced weights (their flat sum, reduced already) as differentiable outputs of the
    stacked contributions; the backward posts the all-reduce of the gradients (awaited by
    :class:`_AwaitGradients`): the owner's contribution is the parameters, so its gradient is every
    rank's gradient summed (the paper's reduce to the owner). torch.distributed.nn.functional.all_reduce
    does this too, but is deprecated and synchronous."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, reduced: torch.Tensor, group: dist.ProcessGroup, gradients: _GradientReduce,
        *stacked: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.gradients = group, gradients  # type: ignore[attr-defined]
        sizes = [t.numel() for t in stacked]
        return tuple(part.view_as(t).clone() for part, t in zip(reduced.split(sizes), stacked, strict=True))

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        summed = torch.cat([g.reshape(-1) for g in grads])
        gradients: _GradientReduce = ctx.gradients  # type: ignore[attr-defined]
        gradients.nbytes = summed.nbytes
        gradients.work = all_reduce(summed, ctx.group, async_op=True)  # type: ignore[attr-defined]
        parts = summed.split([g.numel() for g in grads])  # read only once the work is done
        return (None, None, None, *(part.view_as(g) for part, g in zip(parts, grads, strict=True)))


def run_with_shadows(
    plan: ShadowPlan, dispatched_ECM: torch.Tensor, shadows: PendingShadows,
    local_compute: ExpertCompute, run_exchanged: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The combined (E, C, M) buffer: the others by ``run_exchanged`` (the schedule) on the first
    ``exchanged_slots`` slots while the shadowed weights arrive, then the shadowed experts' slots
    computed here."""
    exchanged = min(plan.exchanged_slots, dispatched_ECM.shape[1])
    combined_ECM = F.pad(run_exchanged(dispatched_ECM[:, :exchanged]), (0, 0, 0, dispatched_ECM.shape[1] - exchanged))
    index = torch.tensor(plan.experts, dtype=torch.long, device=dispatched_ECM.device)
    local_SCM = pipelined_experts(
        dispatched_ECM.index_select(0, index), local_compute, shadows.wait(),
        ExpertExchange(None, LOCAL, len(plan.experts)), 1,
    )
    return combined_ECM.index_copy(0, index, local_SCM)


@dataclass(frozen=True)
class ShadowedSchedule(WrappingSchedule):
    """The expert-parallel schedule with FasterMoE's shadows: each forward decides the shadowed
    experts from the kept counts (``setting``: "auto", priced on ``cost``, or fixed experts), runs
    them here on this rank's own tokens and only the others through the inner schedule."""

    setting: str | tuple[int, ...] = "auto"
    cost: CostModel | None = None
    model_dim: int = 0
    hidden_dim: int = 0
    projections: int = 2

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        if ctx.world_size == 1:
            return self.inner.run(plan, dispatched_ECM, ctx)
        prices = None if self.cost is None else ShadowPrices.from_cost_model(
            self.cost, self.model_dim, self.hidden_dim, self.projections, algorithm=plan.algorithm,
            wire_dtype=ctx.wire_dtype,
        )
        shadow, gain = decide_shadows(self.setting, ctx.filled_WE, ctx.placement, ctx.capacity, prices)
        if shadow is None:
            return dataclasses.replace(self.inner.run(plan, dispatched_ECM, ctx), shadow_predicted_gain_s=gain)
        exchanged = dataclasses.replace(ctx, filled_WE=shadow.exchanged(ctx.filled_WE))  # owners skip shadows
        ran: list[ScheduleOutput] = []

        def run_exchanged(buffer_ECM: torch.Tensor) -> torch.Tensor:
            ran.append(self.inner.run(plan, buffer_ECM, exchanged))
            return ran[-1].combined_ECM

        shadows = post_shadow_weights(ctx.weights(), ctx.placement, ctx.rank, shadow.experts, ctx.groups)
        combined_ECM = run_with_shadows(
            shadow, dispatched_ECM, shadows, ctx.own_compute(shadow.experts), run_exchanged
        )
        # each rank computes what its owned experts receive (the inner report) and its own shadowed tokens
        own_W = ctx.filled_WE[:, list(shadow.experts)].sum(1).tolist()
        load = tuple(received + own for received, own in zip(ran[-1].rank_tokens, own_W, strict=True))
        return ScheduleOutput(combined_ECM, load, shadow.experts, gain, ran[-1].cross_node_rows)
