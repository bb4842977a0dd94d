"""Where each routed assignment goes in the (E, C) slot buffer: one immutable plan per buffer,
built once from the routing and read by encode, decode and their kernels (the torch ones in
:mod:`moeflow.kernels.slot_gather`, the Triton ones in :mod:`moeflow.kernels.triton_dispatch`).

Shapes: T tokens, K top-k, N kept (token, expert) assignments, E experts, C capacity, S = E*C slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.core.device_copy import to_device


@dataclass(frozen=True)
class SlotMap:
    """Where each kept assignment comes from (token) and goes to (slot = expert * C + location).

    Kept assignments are listed token-major, so the assignments of token t form the bag
    ``offsets_T[t] : offsets_T[t+1]`` (``embedding_bag`` sums such bags in one fused pass). The
    slot-major view (``slot_token_S``, ``empty_slots``) turns scatters into gathers.
    """

    token_idx_N: torch.Tensor
    slot_idx_N: torch.Tensor
    choice_idx_N: torch.Tensor  # the flat (token * K + choice) index of each kept assignment
    choice_mask_TK: torch.Tensor  # True where the (token, choice) was kept
    offsets_T: torch.Tensor  # first kept assignment of each token
    slot_token_S: torch.Tensor  # token held by each slot (0 for an empty slot)
    empty_slots: torch.Tensor  # slots that hold no token
    num_tokens: int
    num_experts: int
    capacity: int
    packed_slots: int | None = None  # a packed plan's kept rows (:func:`make_packed_slot_map`); None: E * C
    occupied_S: torch.Tensor | None = None  # a static plan's filled slots (:func:`make_static_slot_map`)

    @property
    def num_slots(self) -> int:
        return self.num_experts * self.capacity if self.packed_slots is None else self.packed_slots

    def per_slot(self, weight_N: torch.Tensor) -> torch.Tensor:
        """(S,): each slot's gate weight, 0 for an empty slot (decode's backward scales by it)."""
        return weight_N.new_zeros(self.num_slots).index_copy_(0, self.slot_idx_N, weight_N)


def make_slot_map(
    expert_idx_TK: torch.Tensor, location_TK: torch.Tensor, num_experts: int, capacity: int,
    kept: int | None = None,
) -> SlotMap:
    """The plan of the (E, C) buffer: expert e's slots begin at e * C. ``kept``: the number of
    kept assignments where the host knows it (the routing counts every rank agreed): then the plan
    is built with no device sync (on a GPU each boolean-sized index waits for the queue to drain)."""
    first_slot_E = torch.arange(num_experts, device=expert_idx_TK.device) * capacity
    return _plan(expert_idx_TK, location_TK, num_experts, capacity, first_slot_E, None, kept)


def make_packed_slot_map(
    expert_idx_TK: torch.Tensor, location_TK: torch.Tensor, counts_E: torch.Tensor, capacity: int
) -> SlotMap:
    """The plan of a packed buffer that holds only the kept rows, expert after expert (no empty
    slot): what the ragged GEMMs read directly, with no capacity padding to gather them out of.
    ``counts_E``: the assignments per expert before capacity, on the host."""
    kept_E = counts_E.clamp(max=capacity)
    first_slot_E = to_device(torch.cumsum(kept_E, 0) - kept_E, expert_idx_TK.device)
    kept = int(kept_E.sum())
    return _plan(expert_idx_TK, location_TK, counts_E.numel(), capacity, first_slot_E, kept, kept)


def make_static_slot_map(
    expert_idx_TK: torch.Tensor, location_TK: torch.Tensor, num_experts: int, capacity: int
) -> SlotMap:
    """The (E, C) plan with shapes that depend on T, K, E and C alone, so a CUDA graph can hold it:
    every one of the T*K choices is listed (N = T*K, token-major), a dropped one at slot 0 with
    ``choice_mask_TK`` False, and the filled slots are a mask (``occupied_S``) instead of a list
    of the empty ones. Only the kernels that weight each choice by that mask read it right: the
    ``gather`` encode and decode (:mod:`moeflow.kernels.slot_gather`)."""
    num_tokens, top_k = expert_idx_TK.shape
    device, num_slots = expert_idx_TK.device, num_experts * capacity
    kept_TK = location_TK < capacity
    slot_TK = torch.where(kept_TK, expert_idx_TK * capacity + location_TK, num_slots)  # dropped: one slot past the end
    choice_N = torch.arange(num_tokens * top_k, device=device)
    token_N = choice_N.div(top_k, rounding_mode="floor")
    slot_token_S = torch.zeros(num_slots + 1, dtype=torch.int64, device=device).scatter_(0, slot_TK.flatten(), token_N)
    occupied_S = torch.zeros(num_slots + 1, dtype=torch.bool, device=device).index_fill_(0, slot_TK.flatten(), True)
    return SlotMap(
        token_idx_N=token_N,
        slot_idx_N=slot_TK.flatten().masked_fill(~kept_TK.flatten(), 0),
        choice_idx_N=choice_N,
        choice_mask_TK=kept_TK,
        offsets_T=torch.arange(num_tokens, device=device) * top_k,
        slot_token_S=slot_token_S[:num_slots],
        empty_slots=torch.zeros(0, dtype=torch.int64, device=device),
        num_tokens=num_tokens,
        num_experts=num_experts,
        capacity=capacity,
        occupied_S=occupied_S[:num_slots],
    )


def _plan(
    expert_idx_TK: torch.Tensor, location_TK: torch.Tensor, num_experts: int, capacity: int,
    first_slot_E: torch.Tensor, packed_slots: int | None, kept: int | None,
) -> SlotMap:
    num_tokens, top_k = expert_idx_TK.shape
    device = expert_idx_TK.device
    kept_TK = location_TK < capacity
    kept_N = _true_indices(kept_TK.flatten(), kept)
    token_idx_N = kept_N.div(top_k, rounding_mode="floor")
    slot_idx_N = (first_slot_E[expert_idx_TK] + location_TK).flatten().index_select(0, kept_N)
    kept_per_token = kept_TK.sum(dim=1)
    num_slots = num_experts * capacity if packed_slots is None else packed_slots
    slot_token_S = torch.zeros(num_slots, dtype=torch.int64, device=device)
    slot_token_S.index_copy_(0, slot_idx_N, token_idx_N)
    if packed_slots is None:
        occupied_S = torch.zeros(num_slots, dtype=torch.bool, device=device)
        empty = None if kept is None else num_slots - kept
        empty_slots = _true_indices(~occupied_S.index_fill_(0, slot_idx_N, True), empty)
    else:  # every packed slot holds a kept row
        empty_slots = torch.zeros(0, dtype=torch.int64, device=device)
    return SlotMap(
        token_idx_N=token_idx_N,
        slot_idx_N=slot_idx_N,
        choice_idx_N=kept_N,
        choice_mask_TK=kept_TK,
        offsets_T=torch.cumsum(kept_per_token, 0) - kept_per_token,
        slot_token_S=slot_token_S,
        empty_slots=empty_slots,
        num_tokens=num_tokens,
        num_experts=num_experts,
        capacity=capacity,
        packed_slots=packed_slots,
    )


def _true_indices(mask: torch.Tensor, count: int | None) -> torch.Tensor:
    """Where ``mask`` is True; with its ``count`` known on the host, without a device sync."""
    if count is None:
        return mask.nonzero().squeeze(1)
    return torch.nonzero_static(mask, size=count).squeeze(1)
