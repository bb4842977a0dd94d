"""Slot assignment: where each (token, choice) lands in its expert's capacity buffer.

GShard/Tutel order: every token's first choice in token order, then every second choice, and so
on. With batch-prioritized routing (Riquelme et al.) the tokens of every choice rank are ordered by
the token's priority, highest first: Tutel's rule (``extract_critical``) takes the token's highest
routing score, so at k >= 2 a token's second choice keeps the place its first choice earned (ties
keep token order, where Tutel's sort leaves them unordered). An assignment whose slot is at or
beyond the capacity is dropped. Sort-based, O(T*K log(T*K)), no (T, E) or (T, E, C) tensor.
"""

from __future__ import annotations

import torch


def assign_slots(
    expert_idx_TK: torch.Tensor,
    num_experts: int,
    priority_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (location_TK, counts_E): the slot index of each choice in its expert, and the number
    of assignments each expert received (before capacity). ``priority_T``: each token's priority
    (batch-prioritized routing), the same for all its choices."""
    num_tokens, top_k = expert_idx_TK.shape
    device = expert_idx_TK.device
    if priority_T is None:
        token_order = torch.arange(num_tokens, device=device)
    else:
        token_order = torch.sort(-priority_T, stable=True).indices
    fill_order_KT = token_order.expand(top_k, num_tokens)
    expert_in_fill_order = expert_idx_TK.t().gather(1, fill_order_KT).reshape(-1)

    counts_E = expert_counts(expert_in_fill_order, num_experts)
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


def expert_counts(expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how often each expert is named. ``torch.bincount`` on CUDA reads its input's
    maximum back to the host to size its output, a device sync in every routing; a scatter-add into
    E counters does not."""
    flat = expert_idx.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts_E.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
