"""Which dispatcher runs a layer call, decided in one place.

A layer's :class:`Dispatchers` are made when it is built and on ``switch()``: the capacity
dispatcher over its schedule, and the direct path its schedule declares for this rank
(:class:`~moeflow.parallel.direct_path.DirectPath`: the local dispatcher on a rank that holds every
expert, the row paths where each expert has one holder, or none). A call narrows that on this rank
before its one load agreement (:meth:`Dispatchers.agree`) and picks the dispatcher from the load
every rank then holds alike, so no rank skips a collective another runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeflow.core.capacity import never_drops
from moeflow.core.routing.router import Routing
from moeflow.parallel.agreement import CarriedTokens, GlobalLoad, agree_load, bucket_after
from moeflow.parallel.direct_path import DirectPath
from moeflow.parallel.dispatchers.capacity import CapacityDispatcher
from moeflow.parallel.dispatchers.gathered import GatheredDispatcher
from moeflow.parallel.dispatchers.kept_rows import KeptRowsDispatcher
from moeflow.parallel.dispatchers.local import LocalDispatcher
from moeflow.parallel.dispatchers.protocol import Dispatcher, LayerCall
from moeflow.parallel.dispatchers.rows import DIRECT_EXCHANGE_ROWS, RowDispatcher
from moeflow.parallel.dispatchers.static import STATIC, StaticDispatcher
from moeflow.parallel.dispatchers.stats import DirectLabels
from moeflow.parallel.inference_hook import InferenceHook
from moeflow.perf.kernel_rates import AUTO, RAGGED


def runs_static(setting: str, call: LayerCall) -> bool:
    """Whether ``call`` takes the static step under the ``step_shapes`` setting: always under
    ``static`` (the layer refuses several ranks and the config a factor <= 0), and under ``auto``
    for a call with a backward on a GPU with capacity_factor > 0 (where the host's read of the
    counts leaves the device idle; on a CPU the host is the device, and the dynamic paths skip
    the padding)."""
    if setting == STATIC:
        if call.capacity_factor <= 0:
            raise ValueError(f"step_shapes='static' sizes capacity from capacity_factor > 0, got a call with "
                             f"capacity_factor={call.capacity_factor!r}: pass one > 0 or use step_shapes='auto'")
        return True
    return setting == AUTO and call.x_TM.is_cuda and call.capacity_factor > 0 and call.workspace is not None


@dataclass(frozen=True)
class Agreed:
    """The call's dispatcher, the load it runs on, and the tokens per rank the layer's next load
    agreement carries (None: as before)."""

    dispatcher: Dispatcher
    load: GlobalLoad
    next_bucket: int | None = None


@dataclass(frozen=True)
class Dispatchers:
    """A layer's dispatchers over one schedule and placement: the capacity path, and the direct path
    the schedule declares for this rank (``declared``; None: every call takes the capacity path)."""

    capacity: CapacityDispatcher
    declared: DirectPath | None
    local: LocalDispatcher
    kept_rows: KeptRowsDispatcher
    rows: RowDispatcher
    static: StaticDispatcher
    hook: InferenceHook | None  # the schedule's per-forward placement scheduler, which sees the routing

    @staticmethod
    def of(capacity: CapacityDispatcher) -> Dispatchers:
        """The dispatchers around ``capacity``, with its schedule's declaration for this rank."""
        groups, experts, config = capacity.groups, capacity.experts, capacity.config
        labels = DirectLabels(capacity.schedule.name, config.pipeline, groups.topology)
        declared = capacity.schedule.direct_path(capacity.placement, groups.rank)
        if config.step_shapes == STATIC and (groups.size > 1 or declared is not DirectPath.LOCAL):
            raise ValueError(f"step_shapes='static' runs on one rank that holds every expert (this layer's expert "
                             f"group has {groups.size} ranks, schedule {capacity.schedule.name!r}): several ranks "
                             "agree their routing counts before the exchange; use step_shapes='auto' or 'dynamic'")
        return Dispatchers(capacity, declared, LocalDispatcher(experts, labels), KeptRowsDispatcher(experts, labels),
                           RowDispatcher(experts, groups, labels), StaticDispatcher(experts, labels),
                           capacity.schedule.hook)

    def agree(self, call: LayerCall, routing: Routing, estimate_E: np.ndarray | None, bucket: int) -> Agreed:
        """The call's dispatcher and its load: the local and kept-rows ones on this rank's counts
        alone; the capacity path and the row paths after the one load all-gather, which under the
        row paths carries whether this rank asks for one and up to ``bucket`` tokens per rank.
        Where every rank asked and the capacity path would drop nothing, tokens that all came along
        run gathered, and up to :data:`DIRECT_EXCHANGE_ROWS` rows per rank run the row exchange."""
        counts_E, num_tokens, groups = routing.counts_E, call.x_TM.shape[0], self.capacity.groups
        path = self._narrowed(call, routing)
        if path is not None and path is not DirectPath.EXCHANGE:
            counts = counts_E if path is self.local or path is self.static else counts_E.cpu()
            return Agreed(path, GlobalLoad(counts.unsqueeze(0), num_tokens))
        if path is None:
            return Agreed(self.capacity, agree_load(counts_E, num_tokens, groups, estimate_E).load)
        choice = routing.choice
        carried = CarriedTokens(call.x_TM, choice.expert_idx_TK, choice.weights_TK, bucket)
        agreement = agree_load(counts_E, num_tokens, groups, asks_direct=call.asks_direct, carried=carried)
        load = agreement.load
        if not agreement.all_direct or load.capacity(call.capacity_factor, call.top_k) < load.needed_capacity:
            return Agreed(self.capacity, load, 0)  # the next agreement carries no tokens it could not use
        following = bucket_after(load)
        if agreement.tokens is not None:
            gathered = GatheredDispatcher(agreement.tokens, self.capacity.experts, groups, self.local.labels)
            return Agreed(gathered, load, following)
        if load.max_tokens_per_rank * call.top_k <= DIRECT_EXCHANGE_ROWS:
            return Agreed(self.rows, load, following)
        return Agreed(self.capacity, load, following)

    def _narrowed(
        self, call: LayerCall, routing: Routing
    ) -> LocalDispatcher | KeptRowsDispatcher | StaticDispatcher | DirectPath | None:
        """This call's path from the declared one: on several ranks exactly the declared row paths
        (each rank decides on its own token count, so none may skip a collective: the agreement
        decides), none for the local one; on one rank the static step where the step-shapes
        setting takes it, the local dispatcher for a no-grad call that cannot drop, else under the
        ragged kernel (``auto``'s choice for the call) the kept-rows one (when no bias moves)."""
        declared = self.declared
        if declared is not DirectPath.LOCAL or self.capacity.groups.size > 1:
            return declared if declared is not DirectPath.LOCAL else None
        if runs_static(self.capacity.config.step_shapes, call):
            return self.static
        num_experts = routing.counts_E.numel()
        if call.asks_direct and never_drops(call.capacity_factor, call.top_k, call.x_TM.shape[0], num_experts):
            return self.local
        if call.moves_bias:
            return None
        kernel = self.capacity.config.expert_kernel
        if kernel == AUTO:  # the kept rows where the ragged kernel is the faster for the slots this call fills
            counts_WE = routing.counts_E.cpu().unsqueeze(0)
            capacity = GlobalLoad(counts_WE, call.x_TM.shape[0]).capacity(call.capacity_factor, call.top_k)
            kernel = self.capacity.expert_kernel(call, counts_WE.clamp(max=capacity), capacity)
        return self.kept_rows if kernel == RAGGED else None
