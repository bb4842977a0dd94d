"""Which dispatcher runs a layer call, decided in one place.

The schedule declares what its placement allows (``ParallelSchedule.direct_path``): the local
dispatcher on a rank that holds every expert, the row paths where each expert has one holder, or
only the capacity path. :func:`direct_path` narrows that for this call on this rank before
routing; :func:`agree` runs the call's one load agreement and picks the dispatcher from the load
every rank then holds alike, so no rank skips a collective another runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeflow.comm.groups import ParallelGroups
from moeflow.core.capacity import never_drops
from moeflow.core.experts import ExpertFFN
from moeflow.parallel.agreement import CarriedTokens, GlobalLoad, agree_load, bucket_after
from moeflow.parallel.dispatchers.gathered import GatheredDispatcher
from moeflow.parallel.dispatchers.local import LocalDispatcher
from moeflow.parallel.dispatchers.packed import PackedDispatcher
from moeflow.parallel.dispatchers.protocol import DispatchCall, Dispatcher
from moeflow.parallel.dispatchers.rows import DIRECT_EXCHANGE_ROWS, RowDispatcher
from moeflow.parallel.dispatchers.stats import DirectLabels

DIRECT_LOCAL = "local"
"""A schedule's direct path on a rank that holds every expert: the local dispatcher."""
DIRECT_EXCHANGE = "exchange"
"""A schedule's direct path where each expert has one holder: the gathered or row-exchange dispatcher."""
DIRECT_PACKED = "packed"
"""One rank under the ragged kernel, with a backward: the packed dispatcher."""


@dataclass(frozen=True)
class CallFacts:
    """What decides a call's path on this rank: its tokens, k and capacity factor, whether it asks
    for a direct path (no backward, no balancing bias to move), whether it moves that bias, and the
    layer's expert kernel."""

    num_tokens: int
    top_k: int
    capacity_factor: float
    asks_direct: bool
    moves_bias: bool
    ragged_kernel: bool


def direct_path(declared: str | None, world_size: int, num_experts: int, facts: CallFacts) -> str | None:
    """This call's path from the schedule's ``declared`` one: on several ranks exactly the declared
    row paths (each rank decides on its own token count, so none may skip a collective: the
    agreement decides), none for the local one; on one rank the local dispatcher for a no-grad call
    that cannot drop, else under the ragged kernel the packed one (when no bias moves)."""
    if declared != DIRECT_LOCAL or world_size > 1:
        return declared if declared != DIRECT_LOCAL else None
    if facts.asks_direct and never_drops(facts.capacity_factor, facts.top_k, facts.num_tokens, num_experts):
        return declared
    return DIRECT_PACKED if facts.ragged_kernel and not facts.moves_bias else None


@dataclass(frozen=True)
class Agreed:
    """The call's dispatcher, the load it runs on, and the tokens per rank the layer's next load
    agreement carries (None: as before)."""

    dispatcher: Dispatcher
    load: GlobalLoad
    next_bucket: int | None = None


def agree(
    path: str | None, call: DispatchCall, groups: ParallelGroups, estimate_E: np.ndarray | None, bucket: int,
    asks_direct: bool, capacity: Callable[[], Dispatcher], experts: ExpertFFN, labels: DirectLabels,
) -> Agreed:
    """The dispatcher of ``path`` and its load (``capacity`` makes the capacity dispatcher, only where
    it runs): the local and packed ones on this rank's counts alone;
    the capacity path and the row paths after the one load all-gather, which under the row paths
    carries whether this rank asks for one (``asks_direct``) and up to ``bucket`` tokens per rank.
    Where every rank asked and the capacity path would drop nothing, tokens that all came along run
    gathered, and up to :data:`DIRECT_EXCHANGE_ROWS` rows per rank run the row exchange."""
    counts_E, num_tokens = call.routing.counts_E, call.x_TM.shape[0]
    if path == DIRECT_LOCAL:
        return Agreed(LocalDispatcher(experts, labels), GlobalLoad(counts_E.unsqueeze(0), num_tokens))
    if path == DIRECT_PACKED:
        return Agreed(PackedDispatcher(experts, labels), GlobalLoad(counts_E.cpu().unsqueeze(0), num_tokens))
    if path is None:
        return Agreed(capacity(), agree_load(counts_E, num_tokens, groups, estimate_E).load)
    choice = call.routing.choice
    carried = CarriedTokens(call.x_TM, choice.expert_idx_TK, choice.weights_TK, bucket)
    agreement = agree_load(counts_E, num_tokens, groups, asks_direct=asks_direct, carried=carried)
    load = agreement.load
    if not agreement.all_direct or load.capacity(call.capacity_factor, call.top_k) < load.needed_capacity:
        return Agreed(capacity(), load, 0)  # the next agreement carries no tokens it could not use
    following = bucket_after(load)
    if agreement.tokens is not None:
        return Agreed(GatheredDispatcher(agreement.tokens, experts, groups, labels), load, following)
    if load.max_tokens_per_rank * call.top_k <= DIRECT_EXCHANGE_ROWS:
        return Agreed(RowDispatcher(experts, groups, labels), load, following)
    return Agreed(capacity(), load, following)
