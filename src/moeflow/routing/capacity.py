"""Expert capacity (Tutel Eq. 1 and its dynamic capacity factor)."""

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
    - f < 0: ``needed`` capped at ceil(k * |f| * T / E)
    """
    if capacity_factor > 0:
        return math.ceil(top_k * capacity_factor * num_tokens / num_experts)
    if capacity_factor == 0:
        return needed
    return min(needed, math.ceil(top_k * -capacity_factor * num_tokens / num_experts))
