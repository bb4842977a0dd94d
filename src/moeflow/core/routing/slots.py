"""Slot assignment: where each (token, choice) lands in its expert's capacity buffer.

GShard/Tutel order: every token's first choice in token order, then every second choice, and so
on. With batch-prioritized routing (Riquelme et al.) the tokens of every choice rank are ordered by
the token's priority, highest first: Tutel's rule (``extract_critical``) takes the token's highest
routing score, so at k >= 2 a token's second choice keeps the place its first choice earned (ties
keep token order, where Tutel's sort leaves them unordered). An assignment whose slot is at or
beyond the capacity is dropped. A dropless call may fill token-major instead (nothing is dropped,
so the order decides nothing): a token's copies then sit together in the pipeline's capacity
chunks. Sort-based, O(T*K log(T*K)), no (T, E) or (T, E, C) tensor.
"""

from __future__ import annotations

import torch


def assign_slots(
    expert_idx_TK: torch.Tensor,
    num_experts: int,
    priority_T: torch.Tensor | None = None,
    token_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (location_TK, counts_E): the slot index of each choice in its expert, and the number
    of assignments each expert received (before capacity). ``priority_T``: each token's priority
    (batch-prioritized routing), the same for all its choices.

    Slots fill choice-major (GShard's order: every token's first choice before any second, so a
    capacity drops second choices first), or with ``token_major`` a token's choices together: for a
    dropless call, where the order decides nothing, so that a token's copies take nearby slots of
    their experts and a capacity chunk of the pipeline holds them together (what lets the dedup
    exchange send a token once per chunk)."""
    num_tokens, top_k = expert_idx_TK.shape
    device = expert_idx_TK.device
    if priority_T is None:
        token_order = torch.arange(num_tokens, device=device)
    else:
        token_order = torch.sort(-priority_T, stable=True).indices
    if token_major:
        return _token_major_slots(expert_idx_TK, num_experts, token_order)
    fill_order_KT = token_order.expand(top_k, num_tokens)
    expert_in_fill_order = expert_idx_TK.t().gather(1, fill_order_KT).reshape(-1)

    counts_E = expert_counts(expert_in_fill_order, num_experts)
    location_in_fill_order = _rank_within_expert(expert_in_fill_order, counts_E)

    location_KT = torch.empty((top_k, num_tokens), dtype=torch.int64, device=device)
    location_KT.scatter_(1, fill_order_KT, location_in_fill_order.view(top_k, num_tokens))
    return location_KT.t(), counts_E


def _rank_within_expert(expert_in_fill_order: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Each assignment's place among its expert's, in fill order (a stable sort by expert)."""
    order = torch.sort(expert_in_fill_order, stable=True).indices
    first_of_expert_E = torch.cumsum(counts_E, 0) - counts_E
    position = torch.arange(order.numel(), device=order.device)
    rank_within_expert = position - first_of_expert_E[expert_in_fill_order[order]]
    location_in_fill_order = torch.empty_like(rank_within_expert)
    location_in_fill_order[order] = rank_within_expert
    return location_in_fill_order


def _token_major_slots(
    expert_idx_TK: torch.Tensor, num_experts: int, token_order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    expert_in_fill_order = expert_idx_TK.index_select(0, token_order).reshape(-1)  # (token, choice) in fill order
    counts_E = expert_counts(expert_in_fill_order, num_experts)
    location_in_fill_order = _rank_within_expert(expert_in_fill_order, counts_E)
    location_TK = torch.empty_like(expert_idx_TK, dtype=torch.int64)
    location_TK[token_order] = location_in_fill_order.view(expert_idx_TK.shape)
    return location_TK, counts_E


def expert_counts(expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how often each expert is named. ``torch.bincount`` on CUDA reads its input's
    maximum back to the host to size its output, a device sync in every routing; a scatter-add into
    E counters does not."""
    flat = expert_idx.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts_E.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
