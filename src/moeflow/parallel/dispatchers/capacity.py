"""The capacity dispatcher: every forward that no direct dispatcher takes.

The agreed load sizes the capacity; the schedule prepares its run over the kept counts; the planner
chooses this call's plan (pipeline degree, all-to-all algorithm, exchange, r); the tokens this rank
owns are encoded into an (E, C, M) buffer, the schedule runs dispatch -> experts -> combine over it
(padded or ragged, pipelined over capacity chunks), and decode sums each token's k rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.config import MoEConfig
from moeflow.core.experts import ExpertFFN
from moeflow.core.stats import PipelineTiming
from moeflow.core.workspace import Workspace
from moeflow.kernels.slot_gather import SlotMap, decode, encode, make_slot_map
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.context import RunContext
from moeflow.parallel.dispatchers.capacity_stats import routing_stats
from moeflow.parallel.dispatchers.protocol import DispatchCall, Dispatched
from moeflow.parallel.forward_memory import ForwardMemory, ForwardRecord
from moeflow.parallel.online_planner import OnlinePlanner
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.schedules import ParallelSchedule
from moeflow.perf.shape import RegionShape


@dataclass(frozen=True)
class CapacityDispatcher:
    """One layer call's capacity path: the layer's schedule over its placement, its planner, and the
    forward's record (what a recompute repeats) and workspace (None: a no-grad forward)."""

    schedule: ParallelSchedule
    placement: ExpertPlacement
    groups: ParallelGroups
    config: MoEConfig
    experts: ExpertFFN
    planner: OnlinePlanner
    memory: ForwardMemory
    record: ForwardRecord
    workspace: Workspace | None
    r: int | None = None  # Tutel's r for this call

    def run(self, call: DispatchCall, load: GlobalLoad) -> Dispatched:
        config, rank, x_TM = self.config, self.groups.rank, call.x_TM
        capacity = load.capacity(call.capacity_factor, call.top_k)
        filled_WE = load.counts_WE.clamp(max=capacity)  # every rank's kept tokens per expert
        prepared = self.schedule.prepare(capacity, filled_WE, self.placement, rank)
        region = RegionShape(config.dims, self.groups.size, prepared.capacity, x_TM.element_size(),
                             load.max_tokens_per_rank, load.needed_capacity, config.wire_dtype)
        backward = torch.is_grad_enabled()
        chosen, timing = self.memory.plan(self.record, call.recompute,
                                          lambda: self.planner.choose(region, backward=backward, r=self.r))
        if chosen.source == "trial" and x_TM.is_cuda:  # the trial compares device time, not queueing time
            timing.synced_device = str(x_TM.device)
        # the tokens this rank encodes and decodes (Parm's S1: this MP member's share)
        share = self.schedule.token_share(chosen.plan, self.groups, config.num_experts, timing)
        owned = share.own(x_TM, call.routing.slotted(config.num_experts), capacity, call.capacity_factor)
        plan = make_slot_map(owned.expert_idx_TK, owned.location_TK, config.num_experts, owned.capacity,
                                  share.kept_count(filled_WE, rank))
        # encode -> schedule.run (dispatch -> experts -> combine, pipelined) -> decode
        dispatched_ECM = encode(owned.x_TM, plan, self.workspace, call.kernels.encode)
        ctx = run_context(self.experts, self.placement, self.groups, config, x_TM.dtype, timing, filled_WE, capacity,
                          call.kernels.gemm, load.estimate_E, prepared.state, self.workspace, plan, owned.weights_TK)
        ran = self.schedule.run(chosen.plan, dispatched_ECM, ctx)
        weights_TK = torch.ones_like(owned.weights_TK) if ran.weighted else owned.weights_TK  # already applied
        y_TM = share.output(decode(ran.combined_ECM, weights_TK, plan, self.workspace, call.kernels.decode), len(x_TM))
        if call.recompute:  # activation checkpointing's repeat: nothing to report twice
            return Dispatched(y_TM, None)
        stats = routing_stats(config, self.groups, load, capacity, call.top_k, call.capacity_factor, chosen, timing,
                              self.schedule.plan_label(chosen.plan), owned, ran, call.kernels.as_dict())
        return Dispatched(y_TM, stats)


def run_context(
    experts: ExpertFFN, placement: ExpertPlacement, groups: ParallelGroups, config: MoEConfig, dtype: torch.dtype,
    timing: PipelineTiming, filled_WE: torch.Tensor, capacity: int, backend: str, estimate_E: np.ndarray | None = None,
    prepared: object | None = None, workspace: Workspace | None = None, slots: SlotMap | None = None,
    weights_TK: torch.Tensor | None = None,
) -> RunContext:
    """What a schedule runs with: ``experts`` over ``placement`` on this rank of ``groups``, the kept counts
    (and, where the caller has the dispatched buffer's slot map and gate weights, each slot's token and weight)."""
    local = tuple(shard.expert for shard in placement.local(groups.rank))
    return RunContext(experts, dtype, groups, placement, timing, workspace, filled_WE, local, capacity,
                      config.expert_kernel, backend, estimate_E, prepared, config.wire_dtype, slots, weights_TK)
