"""The capacity dispatcher: every forward that no direct dispatcher takes.

The agreed load sizes the capacity; the schedule prepares its run over the kept counts; the planner
chooses this call's plan (pipeline degree, all-to-all algorithm, exchange, r); the tokens this rank
owns are gathered into an (E, C, M) buffer (dispatch), the schedule runs its exchange around the
experts over it (padded or ragged, pipelined over capacity chunks), and the scatter sums each
token's k rows (combine).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.config import MoEConfig
from moeflow.core.experts import ExpertFFN
from moeflow.core.routing.router import Routing
from moeflow.kernels.slot_gather import SlotMap, decode, encode, make_slot_map
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.context import RunContext, ScheduleOutput, layer_context
from moeflow.parallel.dispatchers.capacity_stats import routing_stats
from moeflow.parallel.dispatchers.protocol import LayerCall, Stats
from moeflow.parallel.kernel_probe import probe_kernel_rates
from moeflow.parallel.online_planner import OnlinePlanner, PlanChoice
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.schedules import ParallelSchedule
from moeflow.parallel.token_share import OwnedTokens, TokenShare
from moeflow.perf.kernel_rates import AUTO, BMM
from moeflow.perf.shape import RegionShape


@dataclass(frozen=True)
class CapacityDispatcher:
    """A layer's capacity path: its schedule over its placement and its planner (a recompute takes
    its forward's plan from the call's record). Made when the layer is built and on ``switch()``; a call's own
    values come in its :class:`~moeflow.parallel.dispatchers.protocol.LayerCall`."""

    schedule: ParallelSchedule
    placement: ExpertPlacement
    groups: ParallelGroups
    config: MoEConfig
    experts: ExpertFFN
    planner: OnlinePlanner

    @functools.cached_property
    def local(self) -> tuple[int, ...]:
        """The global index of each local expert (its placement's, on this rank): read every call."""
        return tuple(shard.expert for shard in self.placement.local(self.groups.rank))

    def expert_kernel(self, call: LayerCall, filled_WE: torch.Tensor, capacity: int) -> str:
        """The kernel this call's experts run: the setting, or under ``auto`` the faster of ``bmm`` and
        ``ragged`` for the slots this rank's experts fill (``filled_WE``: kept tokens per source rank
        and expert), by the rates probed at the layer's first call in training mode (on every rank
        at once: the probe's times are agreed in a collective, and grad mode may differ between
        ranks, training mode not). ``bmm`` where no backward runs (the experts then run ragged
        anyway: :meth:`RunContext.compute_on`) or the schedule runs no ragged kernel."""
        kernel = self.config.expert_kernel
        if kernel != AUTO:
            return kernel
        if not self.schedule.takes_ragged or capacity == 0:
            return BMM
        sources, local, x_TM = filled_WE.shape[0], list(self.local), call.x_TM
        if self.planner.kernel_rates is None and call.training:
            self.planner.kernel_rates = probe_kernel_rates(
                self.experts.compute, self.experts.weights(), sources, capacity, x_TM.dtype, x_TM.device,
                call.kernels.gemm, self.planner.reduce_max)
        if self.planner.kernel_rates is None or not torch.is_grad_enabled():
            return BMM
        filled = int(filled_WE[:, local].sum())
        return self.planner.kernel_rates.kernel(filled, len(local) * sources * capacity)

    def dispatch(self, call: LayerCall, routing: Routing, load: GlobalLoad) -> CapacityDispatch:
        """The call's plan, the tokens this rank owns in their slots, gathered into the (E, C, M) buffer."""
        config, rank, x_TM = self.config, self.groups.rank, call.x_TM
        capacity = load.capacity(call.capacity_factor, call.top_k)
        filled_WE = load.counts_WE.clamp(max=capacity)  # every rank's kept tokens per expert
        prepared = self.schedule.prepare(capacity, filled_WE, self.placement, rank)
        region = RegionShape(config.dims, self.groups.size, prepared.capacity, x_TM.element_size(),
                             load.max_tokens_per_rank, load.needed_capacity, config.wire_dtype)
        backward = torch.is_grad_enabled()
        chosen, timing = call.record.planned(call.recompute,
                                             lambda: self.planner.choose(region, backward, call.r, call.training))
        if chosen.source == "trial" and x_TM.is_cuda:  # the trial compares device time, not queueing time
            timing.synced_device = str(x_TM.device)
        # the tokens this rank gathers and scatters back (Parm's S1: this MP member's share)
        share = self.schedule.token_share(chosen.plan, self.groups, config.num_experts, timing)
        label = self.schedule.plan_label(chosen.plan)  # the schedule the stats name for this plan
        owned = share.own(x_TM, routing.slotted(config.num_experts), capacity, call.capacity_factor)
        slots = make_slot_map(owned.expert_idx_TK, owned.location_TK, config.num_experts, owned.capacity,
                              share.kept_count(filled_WE, rank))
        rows_ECM = encode(owned.x_TM, slots, call.workspace, call.kernels.encode)
        kernel = self.expert_kernel(call, filled_WE, capacity)
        ctx = layer_context(self.experts, self.placement, self.groups, config, self.local, x_TM.dtype, timing,
                            filled_WE, capacity, call.kernels.gemm, load.estimate_E, prepared.state, call.workspace,
                            slots, owned.weights_TK, kernel)
        return CapacityDispatch(self, call, load, chosen, label, share, owned, slots, ctx, rows_ECM)



@dataclass
class CapacityDispatch:
    """One call on the capacity path: its plan, its owned tokens' slots and the gathered buffer
    (``rows``); the schedule's run (``experts``) and the scatter back (``combine``)."""

    dispatcher: CapacityDispatcher
    call: LayerCall
    load: GlobalLoad
    chosen: PlanChoice
    label: str
    share: TokenShare
    owned: OwnedTokens
    slots: SlotMap
    ctx: RunContext
    rows: torch.Tensor
    ran: ScheduleOutput | None = None

    def experts(self, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's exchange around the experts (dispatch -> experts -> combine, pipelined)."""
        self.ran = self.dispatcher.schedule.run(self.chosen.plan, rows, self.ctx)
        return self.ran.combined_ECM

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Each owned token's k rows summed with its combine weights (already applied where the
        exchange weighted them), then the share's tokens put back in the call's order."""
        assert self.ran is not None, "combine runs after the experts"
        weights_TK = torch.ones_like(self.owned.weights_TK) if self.ran.weighted else self.owned.weights_TK
        call = self.call
        y_TM = decode(rows, weights_TK, self.slots, call.workspace, call.kernels.decode)
        return self.share.output(y_TM, len(call.x_TM))

    def stats(self) -> Stats:
        """None for a recompute (activation checkpointing's repeat: nothing to report twice)."""
        call, dispatcher = self.call, self.dispatcher
        if call.recompute or self.ran is None:
            return None
        return routing_stats(dispatcher.config, dispatcher.groups, self.load, self.ctx.capacity, call.top_k,
                             call.capacity_factor, self.chosen, self.ctx.timing, self.label, self.owned, self.ran,
                             self.ctx.kernel, call.kernels.as_dict())
