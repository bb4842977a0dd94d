"""Slot assignment: where each (token, choice) lands in its expert's capacity buffer.

GShard/Tutel order: every token's first choice in token order, then every second choice, and so
on. With batch-prioritized routing (Riquelme et al.) the tokens within one choice rank are ordered by
the score of that choice, highest first (ties keep token order). An assignment whose slot is at or
beyond the capacity is dropped. Sort-based, O(T*K log(T*K)), no (T, E) or (T, E, C) tensor.
"""

from __future__ import annotations

import torch


def assign_slots(
    expert_idx_TK: torch.Tensor,
    num_experts: int,
    priority_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (location_TK, counts_E): the slot index of each choice in its expert, and the number
    of assignments each expert received (before capacity)."""
    num_tokens, top_k = expert_idx_TK.shape
    device = expert_idx_TK.device
    if priority_TK is None:
        fill_order_KT = torch.arange(num_tokens, device=device).expand(top_k, num_tokens)
    else:
        fill_order_KT = torch.sort(-priority_TK.t(), dim=1, stable=True).indices
    expert_in_fill_order = expert_idx_TK.t().gather(1, fill_order_KT).reshape(-1)

    counts_E = torch.bincount(expert_in_fill_order, minlength=num_experts)
    order = torch.sort(expert_in_fill_order, stable=True).indices
    first_of_expert_E = torch.cumsum(counts_E, 0) - counts_E
    rank_within_expert = (
        torch.arange(order.numel(), device=device) - first_of_expert_E[expert_in_fill_order[order]]
    )
    location_in_fill_order = torch.empty_like(rank_within_expert)
    location_in_fill_order[order] = rank_within_expert

    location_KT = torch.empty((top_k, num_tokens), dtype=torch.int64, device=device)
    location_KT.scatter_(1, fill_order_KT, location_in_fill_order.view(top_k, num_tokens))
    return location_KT.t(), counts_E
