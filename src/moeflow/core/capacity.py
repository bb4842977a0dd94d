"""Expert capacity (Tutel Eq. 1 and its dynamic capacity factor): the one formula that the layer
runs and the performance models plan with. Plain math, no torch."""

from __future__ import annotations

import math


def expert_capacity(
    capacity_factor: float, top_k: int, num_tokens: int, num_experts: int, needed: int
) -> int:
    """Slots per expert on one rank.

    ``num_tokens`` is T, the tokens of one rank; ``needed`` is the largest number of tokens any
    rank routes to any one expert in this iteration (the capacity that drops nothing).

    - f > 0: ceil(k * f * T / E)
    - f = 0: ``needed``
    - f < 0: ``needed`` capped at ``ceil(k * |f| * T / E)``
    """
    if capacity_factor > 0:
        return math.ceil(top_k * capacity_factor * num_tokens / num_experts)
    if capacity_factor == 0:
        return needed
    return min(needed, math.ceil(top_k * -capacity_factor * num_tokens / num_experts))


def estimated_needed_capacity(top_k: int, num_tokens: int, num_experts: int) -> int:
    """What a planner assumes for ``needed`` before any routing is seen: the balanced load
    ceil(k * T / E). The layer plans with the measured value; ``moeflow plan`` and the
    benchmarks, which plan before a forward runs, use this."""
    return math.ceil(top_k * num_tokens / num_experts)


def never_drops(capacity_factor: float, top_k: int, num_tokens: int, num_experts: int) -> bool:
    """Whether this capacity drops no assignment whatever the routing: a token picks an expert at
    most once, so no expert gets more than T of one rank's assignments, and C >= T keeps them all."""
    return expert_capacity(capacity_factor, top_k, num_tokens, num_experts, needed=num_tokens) >= num_tokens
