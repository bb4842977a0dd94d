"""Which of the layer's routed tokens a rank encodes, sends and decodes.

Every schedule but one handles all the tokens its rank routed (:data:`ALL_TOKENS`). Parm's S1
("disable MP before the gate, enable it after the combine", §III-B) runs behind tensor-parallel
attention, whose MP members hold the same tokens: each member handles its own 1/N_MP of them and
an MP all-gather of the decoded rows makes the output whole again (:class:`MPTokenShare`), in one
of two ways:

- ``partitioned`` (``parallel="s1"``, as the paper): each member routes its own partition as a
  rank of its own would: slots filled over the partition's tokens, capacity from the partition's
  size (the largest partition's, agreed like ranks agree theirs), so drops are the partition's.
  The token choices and the balance loss come from the gate over all the tokens (a T x M x E
  product, small beside the experts), which every member computes: a choice is per token, so it
  is the partition's own, and the gate's weights then get their whole gradient on every member
  without an MP all-reduce.
- packed (``parallel="auto"``'s S1): routing stays whole on every member, so slots, capacity and
  drops are those of S2 and of the reference whatever schedule the planner picks per iteration.
  Each member packs the slots its own tokens hold, per expert in slot order, into a buffer of the
  largest such count over members and experts: the members' all-to-alls stay equal-sized and
  carry about 1/N_MP of the slots each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from moeflow.comm.collectives import all_gather, all_reduce
from moeflow.comm.groups import group_rank, group_size
from moeflow.comm.ledger import CollectiveLedger, tracked
from moeflow.comm.mp import gather_rows, member_rows, split_rows
from moeflow.core.capacity import expert_capacity
from moeflow.core.routing.router import Routing
from moeflow.core.routing.slots import assign_slots
from moeflow.core.stats import PipelineTiming


@dataclass(frozen=True)
class OwnedTokens:
    """The tokens this rank encodes and decodes, and the (expert, slot) of each of their choices in
    a buffer of ``capacity`` slots per expert (a slot >= capacity is a dropped choice)."""

    x_TM: torch.Tensor
    weights_TK: torch.Tensor
    expert_idx_TK: torch.Tensor
    location_TK: torch.Tensor
    capacity: int
    dropped_E: list[int] | None = None  # where the share drops by its own capacity: per expert, all ranks


class TokenShare(Protocol):
    """What a schedule's tokens are: :meth:`own` picks them (after the whole routing, at
    ``capacity`` slots per expert; ``capacity_factor`` is the call's) and :meth:`output` makes
    the layer's output from their decoded rows."""

    def own(self, x_TM: torch.Tensor, routing: Routing, capacity: int, capacity_factor: float) -> OwnedTokens: ...

    def output(self, y_TM: torch.Tensor, num_tokens: int) -> torch.Tensor: ...

    def kept_count(self, filled_WE: torch.Tensor, rank: int) -> int | None:
        """How many choices :meth:`own`'s tokens keep, where the agreed load (``filled_WE``: every
        rank's kept assignments per expert, on the host) tells it: the plan then needs no device sync."""
        ...


class AllTokens:
    """The rank handles every token it routed."""

    def own(self, x_TM: torch.Tensor, routing: Routing, capacity: int, capacity_factor: float) -> OwnedTokens:
        return OwnedTokens(x_TM, routing.choice.weights_TK, routing.choice.expert_idx_TK, routing.location_TK,
                           capacity)

    def output(self, y_TM: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return y_TM

    def kept_count(self, filled_WE: torch.Tensor, rank: int) -> int | None:
        return int(filled_WE[rank].sum())


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
    capacity of the members' buffers is agreed over ``expert_group`` (the all-to-all's ranks).
    ``partitioned``: each member's slots and capacity are its partition's (the paper's S1);
    otherwise the whole routing's, packed. Its collectives run outside the pipeline: ``timing``
    counts them (forward in ``gather_s``, backward in ``backward_s``), so the planner's trials see
    S1's whole cost."""

    group: dist.ProcessGroup
    expert_group: dist.ProcessGroup
    num_experts: int
    timing: PipelineTiming
    partitioned: bool = False
    ledger: CollectiveLedger | None = None  # records the capacity agreement, as every collective of a layer

    def own(self, x_TM: torch.Tensor, routing: Routing, capacity: int, capacity_factor: float) -> OwnedTokens:
        began = self.timing.now()
        members, member = group_size(self.group), group_rank(self.group)
        start, stop = member_rows(x_TM.shape[0], members, member)
        expert_idx_TK = routing.choice.expert_idx_TK
        if self.partitioned:
            location_TK, own_capacity, dropped_E = self._partition_slots(routing, start, stop, capacity_factor)
        else:
            location_TK, own_capacity = self._packed_slots(routing, capacity, members, member)
            dropped_E = None
        self.timing.gather_s += self.timing.now() - began
        # the split's backward all-gathers the members' row gradients: x and the combine weights
        # get the whole gradient on every member, as replicated tensors must
        return OwnedTokens(
            split_rows(x_TM, self.group, self.timing), split_rows(routing.choice.weights_TK, self.group, self.timing),
            expert_idx_TK[start:stop], location_TK, own_capacity, dropped_E,
        )

    def _packed_slots(self, routing: Routing, capacity: int, members: int, member: int) -> tuple[torch.Tensor, int]:
        packed_TK, own_capacity = packed_locations(
            routing.choice.expert_idx_TK, routing.location_TK, capacity, self.num_experts, members, member
        )
        agreed = torch.tensor([own_capacity], device=packed_TK.device)  # other MP groups' tokens differ
        with tracked(self.ledger, "S1 capacity all-reduce", self.expert_group, agreed.numel() * agreed.element_size()):
            all_reduce(agreed, self.expert_group, "max")
        packed_capacity = int(agreed)
        return packed_TK.masked_fill(packed_TK >= own_capacity, packed_capacity), packed_capacity  # dropped stay

    def _partition_slots(
        self, routing: Routing, start: int, stop: int, capacity_factor: float
    ) -> tuple[torch.Tensor, int, list[int]]:
        """This member's partition routed as a rank of its own: (its slots, the capacity every
        member agrees on, the choices dropped per expert over the expert group's partitions)."""
        expert_idx_TK = routing.choice.expert_idx_TK[start:stop]
        priority_T = None if routing.priority_T is None else routing.priority_T[start:stop]
        location_TK, counts_E = assign_slots(expert_idx_TK, self.num_experts, priority_T)
        local = torch.cat([counts_E.new_tensor([stop - start]), counts_E])
        parts = [torch.empty_like(local) for _ in range(group_size(self.expert_group))]
        with tracked(self.ledger, "S1 partition all-gather", self.expert_group, local.numel() * local.element_size()):
            all_gather(parts, local, self.expert_group)
        gathered = torch.stack(parts).cpu()  # (ranks, 1 + E): each rank's partition size and counts
        top_k = expert_idx_TK.shape[1]
        capacity = expert_capacity(capacity_factor, top_k, int(gathered[:, 0].max()), self.num_experts,
                                   int(gathered[:, 1:].max()))
        dropped_E = (gathered[:, 1:] - capacity).clamp(min=0).sum(0).tolist()
        return location_TK, capacity, dropped_E

    def output(self, y_TM: torch.Tensor, num_tokens: int) -> torch.Tensor:
        began = self.timing.now()
        y_TM = gather_rows(y_TM, num_tokens, self.group)
        self.timing.gather_s += self.timing.now() - began
        return y_TM

    def kept_count(self, filled_WE: torch.Tensor, rank: int) -> int | None:
        return None  # a member's share of the rows is not in the load the ranks agreed
