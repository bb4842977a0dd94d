"""Where each routed assignment goes in the (E, C) slot buffer: one immutable plan per buffer,
built once from the routing and read by encode, decode and their kernels (the torch ones in
:mod:`moeflow.dispatch`, the Triton ones in :mod:`moeflow.kernels.triton_dispatch`).

Shapes: T tokens, K top-k, N kept (token, expert) assignments, E experts, C capacity, S = E*C slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchPlan:
    """Where each kept assignment comes from (token) and goes to (slot = expert * C + location).

    Kept assignments are listed token-major, so the assignments of token t form the bag
    ``offsets_T[t] : offsets_T[t+1]`` (``embedding_bag`` sums such bags in one fused pass). The
    slot-major view (``slot_token_S``, ``empty_slots``) turns scatters into gathers.
    """

    token_idx_N: torch.Tensor
    slot_idx_N: torch.Tensor
    choice_mask_TK: torch.Tensor  # True where the (token, choice) was kept
    offsets_T: torch.Tensor  # first kept assignment of each token
    slot_token_S: torch.Tensor  # token held by each slot (0 for an empty slot)
    empty_slots: torch.Tensor  # slots that hold no token
    num_tokens: int
    num_experts: int
    capacity: int

    @property
    def num_slots(self) -> int:
        return self.num_experts * self.capacity

    def per_slot(self, weight_N: torch.Tensor) -> torch.Tensor:
        """(S,): each slot's gate weight, 0 for an empty slot (decode's backward scales by it)."""
        return weight_N.new_zeros(self.num_slots).index_copy_(0, self.slot_idx_N, weight_N)


def make_dispatch_plan(
    expert_idx_TK: torch.Tensor, location_TK: torch.Tensor, num_experts: int, capacity: int
) -> DispatchPlan:
    num_tokens, top_k = expert_idx_TK.shape
    device = expert_idx_TK.device
    kept_TK = location_TK < capacity
    token_TK = torch.arange(num_tokens, device=device).unsqueeze(1).expand(-1, top_k)
    token_idx_N = token_TK[kept_TK]
    slot_idx_N = (expert_idx_TK * capacity + location_TK)[kept_TK]
    kept_per_token = kept_TK.sum(dim=1)
    num_slots = num_experts * capacity
    slot_token_S = torch.zeros(num_slots, dtype=torch.int64, device=device)
    slot_token_S.index_copy_(0, slot_idx_N, token_idx_N)
    occupied_S = torch.zeros(num_slots, dtype=torch.bool, device=device)
    occupied_S.index_fill_(0, slot_idx_N, True)
    return DispatchPlan(
        token_idx_N=token_idx_N,
        slot_idx_N=slot_idx_N,
        choice_mask_TK=kept_TK,
        offsets_T=torch.cumsum(kept_per_token, 0) - kept_per_token,
        slot_token_S=slot_token_S,
        empty_slots=torch.nonzero(~occupied_S).squeeze(1),
        num_tokens=num_tokens,
        num_experts=num_experts,
        capacity=capacity,
    )
