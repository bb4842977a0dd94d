"""Which load-balancing technique a layer runs, priced by one cost model from its recorded load.

Three candidates, each priced as one training step of the layer's expert region (forward and
backward) on the (W, E) tokens each rank routes to each expert:

- ``off``: expert parallelism as placed (FasterMoE's Eq. 7, :func:`moeflow.perf.shadowing.shadowed_latency`
  with nothing shadowed);
- ``shadowing``: FasterMoE's Algorithm 1 on the same counts (Eq. 8 for the experts it picks);
- ``redundant``: EPLB's slots placed for the load, each replicated expert's tokens split over its
  replicas as the layer splits them (:mod:`moeflow.perf.replicas`): the slowest rank's compute,
  four exchanges of the tokens that leave their rank (forward and backward dispatch and combine,
  priced per link as the ragged exchange sends them) and one all-reduce of the replicated experts'
  gradients.

The same :class:`~moeflow.perf.shadowing.ShadowPrices` price all three, so their differences are
what each technique changes: which rank computes which tokens, what crosses the links, and which
parameters move. The choice is the simplest technique (off, then shadowing, then the slots) within
:data:`~moeflow.perf.schedule_models.MIN_GAIN` of the fastest, as the planner chooses its plans: a
technique that moves weights must predict more than the model's noise to be worth it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.perf.replicas import slot_split
from moeflow.perf.schedule_models import MIN_GAIN
from moeflow.perf.shadowing import ShadowPrices, select_shadowed_experts

OFF, SHADOWING, REDUNDANT = "off", "shadowing", "redundant"
BALANCE_MODES = (OFF, SHADOWING, REDUNDANT)
"""The techniques the choice picks from, simplest first (the order ties are broken in)."""


@dataclass(frozen=True)
class BalanceChoice:
    """The chosen technique and each candidate's predicted step latency of the layer (seconds)."""

    mode: str
    latency_s: dict[str, float]

    @property
    def predicted_gain_s(self) -> float:
        """What the chosen technique saves over ``off``."""
        return self.latency_s[OFF] - self.latency_s[self.mode]


def slot_tokens(tokens_WE: np.ndarray, slot_experts: Sequence[int], slot_ranks: Sequence[int]) -> np.ndarray:
    """(W, P): the tokens each rank sends each slot under the layer's replica split."""
    return slot_split(np.asarray(tokens_WE).round().astype(np.int64), slot_experts, slot_ranks)[1]


def redundant_latency(
    tokens_WE: np.ndarray, slot_experts: Sequence[int], slot_ranks: Sequence[int], prices: ShadowPrices,
) -> float:
    """One training step of the layer over EPLB's slots (see the module's docstring)."""
    tokens_WP = slot_tokens(tokens_WE, slot_experts, slot_ranks).astype(np.float64)
    world = tokens_WP.shape[0]
    on_rank_PW = np.zeros((tokens_WP.shape[1], world))
    on_rank_PW[np.arange(tokens_WP.shape[1]), np.asarray(slot_ranks)] = 1.0
    received_WW = tokens_WP @ on_rank_PW  # tokens rank s sends rank d (the diagonal stays home)
    slowest = max(prices.expert_seconds(float(rows)) for rows in received_WW.sum(0))
    sent_WW = received_WW * (1.0 - np.eye(world)) * prices.row_bytes
    copies = np.bincount(np.asarray(slot_experts))
    replicated = int((copies > 1).sum())
    # parameter_seconds prices two all-reduces of one expert (shadowing's forward and backward):
    # the replicas' gradients take one
    return slowest + 4 * prices.links.exchange_seconds(sent_WW) + replicated * prices.parameter_seconds / 2


def choose_balance(
    tokens_WE: np.ndarray, owner_E: Sequence[int], slot_experts: Sequence[int], slot_ranks: Sequence[int],
    prices: ShadowPrices,
) -> BalanceChoice:
    """The fastest of off, shadowing (Algorithm 1) and redundant slots (``slot_experts`` on
    ``slot_ranks``, placed for this load) for the recorded ``tokens_WE``."""
    tokens = np.asarray(tokens_WE, dtype=np.float64)
    shadowed = select_shadowed_experts(tokens, owner_E, prices)
    latency = {
        OFF: shadowed.latency_without_s,  # Eq. 7, which Algorithm 1 prices first
        SHADOWING: shadowed.latency_with_s,
        REDUNDANT: redundant_latency(tokens, slot_experts, slot_ranks, prices),
    }
    fastest = min(latency.values())
    chosen = next(mode for mode in BALANCE_MODES if latency[mode] <= fastest * (1 + MIN_GAIN))
    return BalanceChoice(chosen, latency)
