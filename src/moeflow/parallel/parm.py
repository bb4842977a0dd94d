"""Parm's schedules for an MoE layer behind tensor-parallel (MP) attention (Parm §III).

Tokens arrive replicated over the MP group (as Megatron / DeepSpeed-MoE pass them) and must leave
replicated. The experts use Parm's EP x ESP layout: rank ep * N_ESP + esp of the layer's group holds
experts [ep * L, (ep + 1) * L) as hidden slice esp. N_ESP defaults to N_MP (Parm's real models'
setting: the MP group of a rank is then also its ESP group); S1 and S2 take any N_ESP dividing the
group, as Table III varies them (the MP split and gather never depend on where the shards are).
The DeepSpeed-MoE baseline gathers the MP members' identical copies over its ESP group, so it
needs N_ESP = N_MP.

- ``s2`` ("disable MP after the gate, enable it before the combine", Fig. 3c): every MP member
  gates all its tokens (identical on the group), keeps its 1/N_MP part of each expert's capacity
  slots (MP-Split), sends it with Parm's fused EP&ESP all-to-all (dump + one all-to-all over all
  W ranks), and after the experts the same all-to-all plus the local sum over the N_ESP hidden
  shards returns its part, which one MP all-gather makes whole again. Compute and all-to-all
  volume fall by N_MP against the DeepSpeed-MoE baseline, which repeats every expert's work on
  each MP member.
- ``ds-baseline`` (DeepSpeed-MoE v0.8.1 as Parm §II-B describes it, Eq. 1): an ESP all-gather of
  the dispatched buffer (N_ESP copies of the same slots, since the tokens are replicated), an EP
  all-to-all over the strided EP group, the shards on every copy, an ESP all-reduce of the shard
  partials, the EP all-to-all back, and this member's copy kept (ESP-Split).

Gradients follow Megatron's convention for a replicated tensor: its gradient is the same on every
MP member, so the all-gather's backward keeps this member's part (and the split's backward is the
all-gather). Under it the dispatch and the combine are each other's adjoint, as the pipeline's
backward needs, and every expert shard sees each token once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.comm.collectives import all_gather_into, all_reduce, all_to_all_single, reduce_scatter_into
from moeflow.comm.ep_esp import ep_esp_combine, ep_esp_dispatch
from moeflow.comm.groups import ParallelGroups, group_rank, group_size
from moeflow.comm.saa import ep_esp_combine_allgather
from moeflow.core.stats import PipelineTiming
from moeflow.parallel.chunk_pipeline import SelfAdjointExchange, pad_slots, padded_slots, pipelined_experts
from moeflow.parallel.context import RunContext, ScheduleOutput
from moeflow.parallel.modelled import ModelledSchedule
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.token_share import ALL_TOKENS, MPTokenShare, TokenShare
from moeflow.perf.parm import BaselineModel, ParmModel, shard_count
from moeflow.perf.schedule_models import Plan


def check_mp_group(groups: ParallelGroups) -> int:
    """The MP group's size, after checking that it is a block of consecutive ranks of the layer's
    group (the layout Parm and Megatron use: MP inside a node)."""
    mp = groups.model
    if mp is None:
        raise ValueError("this schedule needs an mp_group: MoELayer(..., mp_group=<tensor-parallel group>)")
    size = group_size(mp)
    if groups.expert is None or groups.size % size:
        raise ValueError(f"mp_group of {size} ranks must divide the layer's group of {groups.size} ranks")
    members = [dist.get_global_rank(mp, i) for i in range(size)]
    expert_ranks = [dist.get_global_rank(groups.expert, i) for i in range(groups.size)]
    if not set(members) <= set(expert_ranks):
        raise ValueError(f"mp_group (ranks {members}) is not a subgroup of the layer's group (ranks {expert_ranks})")
    first = expert_ranks.index(members[0])
    if members != expert_ranks[first:first + size] or first % size:
        raise ValueError(
            f"mp_group (ranks {members}) must be {size} consecutive ranks of the layer's group starting at a "
            f"multiple of {size}, as tensor-parallel groups are laid out"
        )
    return size


class _TrackedExchange:
    """Parm's exchanges as one entry each way in the groups' ledger (their all-to-all and the MP
    collectives around it: what a hang report names)."""

    groups: ParallelGroups

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        with self.groups.ledger.tracked("Parm dispatch", self.groups.expert, chunk_ECM.nbytes):
            return self._to_experts(chunk_ECM)

    def from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        with self.groups.ledger.tracked("Parm combine", self.groups.expert, y_LXM.nbytes):
            return self._from_experts(y_LXM, rows)

    def _to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class ParmExchange(_TrackedExchange, SelfAdjointExchange):
    """The exchange of S1 and S2: (E, Cj, M) chunks by destination expert <-> the (L, W * Cj / split, M)
    rows of this rank's hidden shards, with Parm's fused EP&ESP all-to-all (dump + one all-to-all
    over all W ranks; back: the all-to-all and the local sum over the N_ESP shards).

    S2 (``split`` = N_MP) sends this member's 1/N_MP of each chunk's slots (MP-Split; a chunk whose
    slots do not split is padded with empty slots) and all-gathers the combined parts over MP.
    S1 (``split`` = 1) sends the whole chunk: it holds only this member's tokens already."""

    groups: ParallelGroups
    esp_size: int
    mp_rank: int
    split: int
    saa: bool = False  # S2: overlap the combine's all-to-all with the MP all-gather

    @property
    def _ep_size(self) -> int:
        return self.groups.size // self.esp_size

    def _to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        assert self.groups.expert is not None
        if self.split > 1:
            chunk_ECM = pad_slots(chunk_ECM, self.split)
            part = chunk_ECM.shape[1] // self.split
            chunk_ECM = chunk_ECM[:, self.mp_rank * part:(self.mp_rank + 1) * part]  # MP-Split
        return ep_esp_dispatch(chunk_ECM.contiguous(), self._ep_size, self.esp_size, self.groups.expert)

    def _from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        assert self.groups.expert is not None
        if self.split == 1:
            return ep_esp_combine(y_LXM, self._ep_size, self.esp_size, rows, self.groups.expert)
        padded = padded_slots(rows, self.split)
        part = padded // self.split
        assert self.groups.model is not None
        if self.saa:
            whole = ep_esp_combine_allgather(y_LXM, self.esp_size, part, self.groups.expert, self.groups.model)
        else:
            own_ECM = ep_esp_combine(y_LXM, self._ep_size, self.esp_size, part, self.groups.expert)
            experts, _, model_dim = own_ECM.shape
            gathered = own_ECM.new_empty((self.split * experts, part, model_dim))
            all_gather_into(gathered, own_ECM.contiguous(), self.groups.model)  # MP-AllGather
            by_member = gathered.view(self.split, experts, part, model_dim)
            whole = by_member.transpose(0, 1).reshape(experts, padded, model_dim)
        return whole if padded == rows else whole[:, :rows]


@dataclass(frozen=True)
class ParmSchedule(ModelledSchedule):
    """Parm's S1 and S2 on the EP x ESP layout (N_ESP hidden shards per expert, by default N_MP),
    behind tensor-parallel attention over the layer's ``mp_group``: ``name`` "s1" or "s2" fixes
    one, "parm" lets the planner choose per iteration (Algorithm 1's choice; both share the layout,
    so switching moves no weight)."""

    mp_size: int
    name: str = "parm"
    esp_size: int | None = None

    @property
    def esp(self) -> int:
        return shard_count(self.mp_size, self.esp_size)

    @property
    def model(self) -> ParmModel:
        return ParmModel(self.name, self.mp_size, esp_size=self.esp_size)

    def placement(self, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        if world_size % self.esp:
            raise ValueError(f"esp_size={self.esp} hidden shards per expert must divide the layer's group of "
                             f"{world_size} ranks: use an esp_size that divides {world_size}")
        return ExpertPlacement.expert_and_hidden_sharded(num_experts, world_size // self.esp, self.esp, hidden_dim)

    def token_share(
        self, plan: Plan, groups: ParallelGroups, num_experts: int, timing: PipelineTiming
    ) -> TokenShare:
        """S1 encodes and decodes this member's tokens only; S2 all of them. ``parallel="s1"``
        routes each member's partition as the paper's S1; ``auto``'s S1 keeps the whole routing,
        so what the layer computes never depends on the schedule the planner picks."""
        if plan.schedule != "s1":
            return ALL_TOKENS
        assert groups.model is not None and groups.expert is not None
        return MPTokenShare(groups.model, groups.expert, num_experts, timing, partitioned=self.name == "s1",
                            ledger=groups.ledger)

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        """The padded kernel: every expert is sharded over its ESP group."""
        mp_rank, esp_rank = group_rank(ctx.groups.model), group_rank(ctx.groups.expert) % self.esp
        compute = dataclasses.replace(ctx.experts.compute, adds_output_bias=esp_rank == 0)  # the shard at hidden 0
        split = self.mp_size if plan.schedule == "s2" else 1
        chunk_exchange = ParmExchange(ctx.groups, self.esp, mp_rank, split, saa=plan.algorithm == "saa")
        return ScheduleOutput(pipelined_experts(
            dispatched_ECM, compute, ctx.weights(), chunk_exchange, plan.degree, ctx.timing, ctx.workspace
        ))


@dataclass(frozen=True)
class BaselineExchange(_TrackedExchange):
    """The DeepSpeed-MoE baseline's exchange (N = N_MP = N_ESP copies, N_EP = W / N ranks in the strided
    EP group, L local experts): (E, Cj, M) <-> (L, N_EP * N * Cj, M). Its combine keeps one copy,
    so the backward runs :meth:`adjoint`, the true adjoint under Megatron's convention."""

    groups: ParallelGroups
    mp_size: int
    mp_rank: int
    backward: bool = False

    @property
    def communicates(self) -> bool:
        return True

    def adjoint(self) -> BaselineExchange:
        return dataclasses.replace(self, backward=not self.backward)

    def chunk(self, start: int, stop: int) -> BaselineExchange:
        return self

    def _ep_exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        """All-to-all over the EP group of (N_EP, ...) blocks by destination -> by source."""
        group = self.groups.strided(self.mp_size)
        if group is None:
            return blocks
        received = torch.empty_like(blocks)
        all_to_all_single(received, blocks.contiguous(), group)
        return received

    def _to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        n, (experts, rows, model_dim) = self.mp_size, chunk_ECM.shape
        ep = self.groups.size // n
        if self.backward:  # adjoint of the combine: this copy only, EP all-to-all, ESP all-reduce
            copies = chunk_ECM.new_zeros((ep, n, experts // ep, rows, model_dim))
            copies[:, self.mp_rank] = chunk_ECM.view(ep, experts // ep, rows, model_dim)
        else:  # ESP all-gather of the (identical) buffers of the MP members
            gathered = chunk_ECM.new_empty((n * experts, rows, model_dim))
            all_gather_into(gathered, chunk_ECM.contiguous(), self.groups.model)
            copies = gathered.view(n, ep, experts // ep, rows, model_dim).transpose(0, 1)
        received = self._ep_exchange(copies.contiguous())  # (N_EP source, N, L, Cj, M)
        rows_LXM = received.permute(2, 0, 1, 3, 4).reshape(experts // ep, ep * n * rows, model_dim)
        if self.backward:
            all_reduce(rows_LXM, self.groups.model)
        return rows_LXM

    def _from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        n, (local, _, model_dim) = self.mp_size, y_LXM.shape
        ep = self.groups.size // n
        if not self.backward:  # ESP all-reduce: the shards' partial outputs summed
            y_LXM = y_LXM.clone()
            all_reduce(y_LXM, self.groups.model)
        blocks = y_LXM.view(local, ep, n, rows, model_dim).permute(1, 2, 0, 3, 4).contiguous()
        returned = self._ep_exchange(blocks)  # (N_EP destination, N copies, L, Cj, M)
        if not self.backward:  # ESP-Split: this member's copy
            return returned[:, self.mp_rank].reshape(ep * local, rows, model_dim)
        by_copy = returned.transpose(0, 1).reshape(n * ep * local, rows, model_dim)
        own = by_copy.new_empty((ep * local, rows, model_dim))
        reduce_scatter_into(own, by_copy.contiguous(), self.groups.model)  # adjoint of the gather
        return own


@dataclass(frozen=True)
class BaselineSchedule(ParmSchedule):
    """DeepSpeed-MoE's MP+EP+ESP baseline on the same EP x ESP layout as S1 and S2."""

    name: str = "ds-baseline"

    def token_share(
        self, plan: Plan, groups: ParallelGroups, num_experts: int, timing: PipelineTiming
    ) -> TokenShare:
        return ALL_TOKENS

    @property
    def model(self) -> BaselineModel:  # type: ignore[override]
        return BaselineModel(self.name, mp_size=self.mp_size)

    def run(self, plan: Plan, dispatched_ECM: torch.Tensor, ctx: RunContext) -> ScheduleOutput:
        mp_rank = group_rank(ctx.groups.model)
        # the N copies of every slot are one tensor under Megatron's convention: each counts 1 / N
        compute = dataclasses.replace(
            ctx.experts.compute, adds_output_bias=mp_rank == 0, weight_grad_scale=1.0 / self.mp_size
        )
        chunk_exchange = BaselineExchange(ctx.groups, self.mp_size, mp_rank)
        return ScheduleOutput(pipelined_experts(
            dispatched_ECM, compute, ctx.weights(), chunk_exchange, plan.degree, ctx.timing, ctx.workspace
        ))
