"""Which of the layer's routed tokens a rank encodes, sends and decodes.

Every schedule but one handles all the tokens its rank routed (:data:`ALL_TOKENS`). Parm's S1
("disable MP before the gate, enable it after the combine", §III-B) runs behind tensor-parallel
attention, whose MP members hold the same tokens: each member handles its own 1/N_MP of them and
an MP all-gather of the decoded rows makes the output whole again (:class:`MPTokenShare`).

Routing stays whole on every member (the gate is a T x M x E product, small beside the experts),
so slots, capacity and drops are those of the reference whatever the split. Each member then
packs the slots its own tokens hold, per expert in slot order, into a buffer of ``capacity`` =
the largest such count over members and experts: the members' all-to-alls stay equal-sized and
carry about 1/N_MP of the slots each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from moeflow.comm.groups import group_rank, group_size
from moeflow.comm.mp import gather_rows, member_rows, split_rows
from moeflow.stats import PipelineTiming


@dataclass(frozen=True)
class OwnedTokens:
    """The tokens this rank encodes and decodes, and the (expert, slot) of each of their choices in
    a buffer of ``capacity`` slots per expert (a slot >= capacity is a dropped choice)."""

    x_TM: torch.Tensor
    weights_TK: torch.Tensor
    expert_idx_TK: torch.Tensor
    location_TK: torch.Tensor
    capacity: int


class TokenShare(Protocol):
    """What a schedule's tokens are: :meth:`own` picks them (after the whole routing) and
    :meth:`output` makes the layer's output from their decoded rows."""

    def own(
        self, x_TM: torch.Tensor, weights_TK: torch.Tensor, expert_idx_TK: torch.Tensor,
        location_TK: torch.Tensor, capacity: int,
    ) -> OwnedTokens: ...

    def output(self, y_TM: torch.Tensor, num_tokens: int) -> torch.Tensor: ...


class AllTokens:
    """The rank handles every token it routed."""

    def own(
        self, x_TM: torch.Tensor, weights_TK: torch.Tensor, expert_idx_TK: torch.Tensor,
        location_TK: torch.Tensor, capacity: int,
    ) -> OwnedTokens:
        return OwnedTokens(x_TM, weights_TK, expert_idx_TK, location_TK, capacity)

    def output(self, y_TM: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return y_TM


ALL_TOKENS = AllTokens()


def packed_locations(
    expert_idx_TK: torch.Tensor, location_TK: torch.Tensor, capacity: int, num_experts: int, members: int,
    member: int,
) -> tuple[torch.Tensor, int]:
    """(slots of ``member``'s rows in its packed buffer, the packed capacity): a kept choice's packed
    slot is its rank among the member's kept choices of the same expert, in slot order; dropped
    choices get the packed capacity. Computed from the whole routing, so every member agrees."""
    num_tokens, top_k = expert_idx_TK.shape
    kept_TK = location_TK < capacity
    share = max(1, -(-num_tokens // members))
    member_TK = (torch.arange(num_tokens, device=expert_idx_TK.device) // share).unsqueeze(1).expand(-1, top_k)
    counts = torch.bincount((member_TK * num_experts + expert_idx_TK)[kept_TK], minlength=members * num_experts)
    packed_capacity = max(1, int(counts.max()))
    start, stop = member_rows(num_tokens, members, member)
    expert_own, location_own = expert_idx_TK[start:stop], location_TK[start:stop]
    kept_own = location_own < capacity
    kept_expert = expert_own[kept_own]
    order = torch.argsort(kept_expert * capacity + location_own[kept_own])
    sorted_expert = kept_expert[order]
    per_expert = torch.bincount(sorted_expert, minlength=num_experts)
    first = torch.cumsum(per_expert, 0) - per_expert
    packed = torch.empty_like(order)
    packed[order] = torch.arange(order.numel(), device=order.device) - first[sorted_expert]
    packed_TK = torch.full_like(location_own, packed_capacity)
    packed_TK[kept_own] = packed
    return packed_TK, packed_capacity


@dataclass(frozen=True)
class MPTokenShare:
    """Parm's MP-Split before the dispatch and MP-AllGather after the decode, over ``group``; the
    packed capacity is agreed over ``expert_group`` (the all-to-all's ranks). Its collectives run
    outside the pipeline: ``timing`` counts them (forward in ``gather_s``, backward in
    ``backward_s``), so the planner's trials see S1's whole cost."""

    group: dist.ProcessGroup
    expert_group: dist.ProcessGroup
    num_experts: int
    timing: PipelineTiming

    def own(
        self, x_TM: torch.Tensor, weights_TK: torch.Tensor, expert_idx_TK: torch.Tensor,
        location_TK: torch.Tensor, capacity: int,
    ) -> OwnedTokens:
        began = self.timing.now()
        members, member = group_size(self.group), group_rank(self.group)
        start, stop = member_rows(x_TM.shape[0], members, member)
        packed_TK, own_capacity = packed_locations(
            expert_idx_TK, location_TK, capacity, self.num_experts, members, member
        )
        agreed = torch.tensor([own_capacity], device=location_TK.device)  # other MP groups' tokens differ
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.expert_group)
        packed_capacity = int(agreed)
        packed_TK = packed_TK.masked_fill(packed_TK >= own_capacity, packed_capacity)  # dropped stay dropped
        self.timing.gather_s += self.timing.now() - began
        # the split's backward all-gathers the members' row gradients: x and the combine weights
        # get the whole gradient on every member, as replicated tensors must
        return OwnedTokens(
            split_rows(x_TM, self.group, self.timing), split_rows(weights_TK, self.group, self.timing),
            expert_idx_TK[start:stop], packed_TK, packed_capacity,
        )

    def output(self, y_TM: torch.Tensor, num_tokens: int) -> torch.Tensor:
        began = self.timing.now()
        y_TM = gather_rows(y_TM, num_tokens, self.group)
        self.timing.gather_s += self.timing.now() - began
        return y_TM
