"""ExpertPlacement: the one place that maps experts to ranks.

For every rank, which experts it holds and which slice of each expert's hidden dimension: whole
(expert parallelism), the same expert on several ranks (replication), or an expert's hidden
dimension split over several ranks (hidden sharding). Everything that asked "where does expert e
live" by arithmetic asks a placement instead: the exchange layout, the slicing of a full (E, ...)
state dict for a rank, and the re-assembly of the full state from every rank's part.

Why not DTensor placements on a DeviceMesh: a mesh places every expert the same way, while some
placements are irregular (EPLB's redundant slots hold a few hot experts twice, Lina's inference
plan places experts unevenly). Instead each placement lists its parts as chunks of the full
tensor (:meth:`ExpertPlacement.chunks`: offsets in the full (E, ...) shape and a view of the local
parameter), which is what torch.distributed.checkpoint stores and reshards by
(:mod:`moeflow.training.sharded_checkpoint`): one description for every placement, regular or not.

Parameter kinds (the last part of a state-dict name) and the axis of their hidden dimension:
``w1``/``w3`` (E, M, H) axis 2, ``b1``/``b3`` (E, H) axis 1, ``w2`` (E, H, M) axis 1; ``b2`` (E, M) has
none: every shard of an expert holds it, and only the shard that starts at hidden 0 adds it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from moeflow.comm.collectives import all_reduce

HIDDEN_AXIS: dict[str, int | None] = {"w1": 2, "w3": 2, "b1": 1, "b3": 1, "w2": 1, "b2": None}


@dataclass(frozen=True, order=True)
class ExpertShard:
    """Expert ``expert``'s hidden units [hidden_start, hidden_stop), held by one rank."""

    expert: int
    hidden_start: int
    hidden_stop: int

    @property
    def adds_output_bias(self) -> bool:
        return self.hidden_start == 0


@dataclass(frozen=True)
class ExpertPlacement:
    """``shards[r]``: the expert shards rank r holds, in local order (its parameters' first axis).

    ``split_tokens``: an expert held by several ranks gets each token once, split over its copies,
    whose gradients are then summed (EPLB's redundant slots); otherwise every copy computes its own
    rank's tokens and the trainer averages the copies' gradients like any replicated weight."""

    num_experts: int
    hidden_dim: int
    shards: tuple[tuple[ExpertShard, ...], ...]
    split_tokens: bool = False

    def __post_init__(self) -> None:
        held = {shard.expert for rank in self.shards for shard in rank}
        if held != set(range(self.num_experts)):
            raise ValueError(f"experts {sorted(set(range(self.num_experts)) - held)} are placed on no rank")
        for rank, shards in enumerate(self.shards):
            if not shards or len({s.hidden_stop - s.hidden_start for s in shards}) != 1:
                raise ValueError(f"rank {rank} must hold at least one shard, all of the same hidden width")

    # -- the placements -------------------------------------------------------------------------

    @classmethod
    def expert_parallel(cls, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        """Expert e whole on rank e // L, L = E / W experts per rank."""
        if num_experts % world_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert group size {world_size}; use a "
                f"multiple of {world_size} experts, a smaller group, or parallel='replicated'"
            )
        local = num_experts // world_size
        ranks = tuple(
            tuple(ExpertShard(e, 0, hidden_dim) for e in range(r * local, (r + 1) * local)) for r in range(world_size)
        )
        return cls(num_experts, hidden_dim, ranks)

    @classmethod
    def replicated(cls, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        """Every rank holds every expert whole."""
        every = tuple(ExpertShard(e, 0, hidden_dim) for e in range(num_experts))
        return cls(num_experts, hidden_dim, (every,) * world_size)

    @classmethod
    def hidden_sharded(cls, num_experts: int, world_size: int, hidden_dim: int) -> ExpertPlacement:
        """W a multiple of E: expert e's hidden dimension split evenly over ranks e*S .. e*S+S-1,
        S = W / E (what Tutel's r needs when there are more ranks than experts)."""
        if world_size % num_experts or hidden_dim % (world_size // num_experts):
            raise ValueError(
                f"hidden sharding needs the group size ({world_size}) to be a multiple of num_experts "
                f"({num_experts}) and hidden_dim ({hidden_dim}) divisible by their ratio"
            )
        return cls.expert_and_hidden_sharded(num_experts, num_experts, world_size // num_experts, hidden_dim)

    @classmethod
    def expert_and_hidden_sharded(
        cls, num_experts: int, ep_size: int, esp_size: int, hidden_dim: int
    ) -> ExpertPlacement:
        """Parm's EP x ESP layout: rank ep * N_ESP + esp holds experts [ep * L, (ep + 1) * L),
        L = E / N_EP, each as hidden slice esp of N_ESP (the ranks of one ESP group are consecutive)."""
        if num_experts % ep_size or hidden_dim % esp_size:
            raise ValueError(
                f"{num_experts} experts of hidden_dim {hidden_dim} cannot be split over {ep_size} expert-parallel "
                f"groups of {esp_size} hidden shards; num_experts must be a multiple of {ep_size} and hidden_dim "
                f"of {esp_size}"
            )
        local, width = num_experts // ep_size, hidden_dim // esp_size
        ranks = tuple(
            tuple(
                ExpertShard(e, (r % esp_size) * width, (r % esp_size + 1) * width)
                for e in range(r // esp_size * local, (r // esp_size + 1) * local)
            )
            for r in range(ep_size * esp_size)
        )
        return cls(num_experts, hidden_dim, ranks)

    @classmethod
    def packed(cls, num_experts: int, world_size: int, group_size: int, hidden_dim: int) -> ExpertPlacement:
        """Lina's expert packing (§4.2): the ranks form blocks of ``group_size`` consecutive ranks,
        each block holds all E experts expert-parallel (rank r: experts [(r mod G) k, (r mod G + 1) k),
        k = E / G), and the W / G blocks are data-parallel copies of each other. G = W is expert
        parallelism, G = 1 replicates every expert."""
        if world_size % group_size or num_experts % group_size:
            raise ValueError(
                f"packing {num_experts} experts into blocks of {group_size} ranks needs group_size to divide both "
                f"the {world_size} ranks and the experts; use a power of two that divides both"
            )
        local = num_experts // group_size
        ranks = tuple(
            tuple(ExpertShard(e, 0, hidden_dim) for e in range(r % group_size * local, (r % group_size + 1) * local))
            for r in range(world_size)
        )
        return cls(num_experts, hidden_dim, ranks)

    # -- questions ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.shards)

    def local(self, rank: int) -> tuple[ExpertShard, ...]:
        return self.shards[rank]

    def local_slices(self, rank: int) -> list[tuple[int, int, int]]:
        """(expert, hidden_start, hidden_stop) of each of ``rank``'s shards, in local order: what
        :meth:`moeflow.core.experts.ExpertFFN.reset_by_expert` draws."""
        return [(shard.expert, shard.hidden_start, shard.hidden_stop) for shard in self.shards[rank]]

    def num_local(self, rank: int) -> int:
        return len(self.shards[rank])

    def experts_per_rank(self) -> list[list[int]]:
        """The expert of each shard, per rank in local order (a plan, as the planners write them)."""
        return [[shard.expert for shard in shards] for shards in self.shards]

    def slots(self) -> tuple[list[int], list[int]]:
        """Every slot's expert and rank, rank-major (what a replicated expert's tokens split over)."""
        return ([shard.expert for shards in self.shards for shard in shards],
                [rank for rank, shards in enumerate(self.shards) for _ in shards])

    def holders(self, expert: int) -> tuple[int, ...]:
        return tuple(r for r, shards in enumerate(self.shards) if any(s.expert == expert for s in shards))

    @functools.cached_property  # asked every no-grad forward (ParallelSchedule.direct_path): computed once
    def is_expert_parallel(self) -> bool:
        """Each expert whole on exactly one rank, ranks holding consecutive experts in equal numbers:
        the layout the equal-split all-to-all exchange assumes (expert e's slots go to rank e // L)."""
        if self.num_experts % self.world_size:
            return False
        return self == ExpertPlacement.expert_parallel(self.num_experts, self.world_size, self.hidden_dim)

    @property
    def packed_group_size(self) -> int | None:
        """G when this is :meth:`packed` with blocks of G ranks (expert parallelism: G = W), else None."""
        per_rank = self.num_local(0)
        if self.split_tokens or self.num_experts % per_rank:
            return None
        group_size = self.num_experts // per_rank
        if self.world_size % group_size:
            return None
        packed = ExpertPlacement.packed(self.num_experts, self.world_size, group_size, self.hidden_dim)
        return group_size if self == packed else None

    def holds_every_expert(self, rank: int) -> bool:
        """``rank`` holds all E experts whole, in expert order (its tokens need no other rank)."""
        return rank in self._ranks_holding_every_expert

    @functools.cached_property
    def _ranks_holding_every_expert(self) -> frozenset[int]:  # asked every forward: computed once
        every = tuple(ExpertShard(expert, 0, self.hidden_dim) for expert in range(self.num_experts))
        return frozenset(rank for rank, shards in enumerate(self.shards) if shards == every)

    @property
    def holds_whole_experts(self) -> bool:
        """Every shard is a whole expert (no hidden slices)."""
        return all(s.hidden_start == 0 and s.hidden_stop == self.hidden_dim for rank in self.shards for s in rank)

    @property
    def is_replicated(self) -> bool:
        return self == ExpertPlacement.replicated(self.num_experts, self.world_size, self.hidden_dim)

    def copies_block(self) -> int | None:
        """B when blocks of B ranks each hold every expert, fewer than all ranks (Lina's packing):
        the copies' gradients then add up over the ranks B apart. None otherwise."""
        block = self.packed_group_size
        return block if block is not None and block < self.world_size else None

    def counted_slots(self, rank: int) -> torch.Tensor | None:
        """Which of ``rank``'s local slots count in a gradient norm when copies of an expert split
        its tokens (EPLB's slots hold the same summed gradient: the primary copy counts); None: all."""
        if not self.split_tokens:
            return None
        return torch.tensor([self.is_primary(rank, index) for index in range(self.num_local(rank))])

    def is_primary(self, rank: int, index: int) -> bool:
        """Whether rank's local shard ``index`` is the first copy of its slice (lowest rank, then
        lowest index): the copy a full state is assembled from."""
        shard = self.shards[rank][index]
        return not any(shard in self.shards[r] for r in range(rank)) and shard not in self.shards[rank][:index]

    # -- state dicts ----------------------------------------------------------------------------

    def shard_tensor(self, kind: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's part of a full (E, ...) tensor of parameter kind ``kind`` (a copy)."""
        self._check_full(kind, full)
        axis = HIDDEN_AXIS[kind]
        return torch.stack([_hidden_slice(full[s.expert], axis, s) for s in self.shards[rank]]).clone()

    def assemble_tensor(self, kind: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full (E, ...) tensor from every rank's part (``parts[r]`` from rank r)."""
        if len(parts) != self.world_size:
            raise ValueError(f"need one part per rank ({self.world_size}), got {len(parts)}")
        full = self.empty_full(kind, parts[0])
        for rank, part in enumerate(parts):
            self.write_primary(kind, part, rank, full)
        return full

    def empty_full(self, kind: str, part: torch.Tensor) -> torch.Tensor:
        """A zero full (E, ...) tensor for a rank's part of kind ``kind``."""
        return part.new_zeros(self.full_shape(kind, part))

    def full_shape(self, kind: str, part: torch.Tensor) -> tuple[int, ...]:
        """The full (E, ...) shape of a rank's part of kind ``kind``."""
        shape = list(part.shape)
        shape[0] = self.num_experts
        axis = HIDDEN_AXIS[kind]
        if axis is not None:
            shape[axis] = self.hidden_dim
        return tuple(shape)

    def chunks(self, kind: str, part: torch.Tensor, rank: int, primary_only: bool) -> list[Chunk]:
        """Rank's part as chunks of the full (E, ...) tensor, runs of consecutive experts with the
        same hidden slice merged. ``primary_only``: only what rank writes when the full tensor is
        saved once (the primary copy of each shard; ``b2`` from the shard that adds it)."""
        axis = HIDDEN_AXIS[kind]
        shards = self.shards[rank]
        kept = [i for i in range(len(shards)) if not primary_only or self._saved_by(rank, i, axis)]
        chunks: list[Chunk] = []
        for first, last in _runs(shards, kept):
            offsets = [0] * part.dim()
            offsets[0] = shards[first].expert
            if axis is not None:
                offsets[axis] = shards[first].hidden_start
            chunks.append(Chunk(tuple(offsets), part[first : last + 1]))
        return chunks

    def _saved_by(self, rank: int, index: int, axis: int | None) -> bool:
        return self.is_primary(rank, index) and (axis is not None or self.shards[rank][index].adds_output_bias)

    def write_primary(self, kind: str, part: torch.Tensor, rank: int, full: torch.Tensor) -> None:
        """Write the primary copies of rank's shards into ``full`` (summing every rank's writes
        into zeros gives the full tensor: what a distributed gather does with one all-reduce)."""
        axis = HIDDEN_AXIS[kind]
        for index, shard in enumerate(self.shards[rank]):
            if not self.is_primary(rank, index) or (axis is None and not shard.adds_output_bias):
                continue
            _hidden_slice(full[shard.expert], axis, shard).copy_(part[index])

    def shard_state(
        self, full_state: Mapping[str, torch.Tensor], rank: int, kind_of: Callable[[str], str | None]
    ) -> dict[str, torch.Tensor]:
        """Slice every expert entry of a state dict for ``rank``; ``kind_of(name)`` names an entry's
        parameter kind, or None for entries that are not this placement's (copied unchanged)."""
        sliced: dict[str, torch.Tensor] = {}
        for name, tensor in full_state.items():
            kind = kind_of(name)
            sliced[name] = tensor.clone() if kind is None else self.shard_tensor(kind, tensor, rank)
        return sliced

    def _check_full(self, kind: str, full: torch.Tensor) -> None:
        if kind not in HIDDEN_AXIS:
            raise ValueError(f"unknown expert parameter kind {kind!r}; expected one of {sorted(HIDDEN_AXIS)}")
        axis = HIDDEN_AXIS[kind]
        if full.shape[0] != self.num_experts or (axis is not None and full.shape[axis] != self.hidden_dim):
            raise ValueError(
                f"{kind} has shape {tuple(full.shape)}; a full state needs {self.num_experts} experts"
                + (f" of hidden size {self.hidden_dim}" if axis is not None else "")
            )


class Chunk(NamedTuple):
    """Part of a full tensor that a rank holds: its offsets in the full shape and a view of the
    rank's local tensor (the chunk's sizes are the view's shape)."""

    offsets: tuple[int, ...]
    view: torch.Tensor


class Sharding(Protocol):
    """A parameter split over ranks: an :class:`ExpertPlacement`, or tensor-parallel attention's
    heads (:class:`moeflow.models.tensor_parallel.HeadShards`, and ``BlockShards`` for a
    transformers model's). What checkpoints and gradient synchronisation ask of it."""

    world_size: int

    @property
    def is_replicated(self) -> bool: ...

    def empty_full(self, kind: str, local: torch.Tensor) -> torch.Tensor: ...

    def full_shape(self, kind: str, local: torch.Tensor) -> tuple[int, ...]: ...

    def chunks(self, kind: str, local: torch.Tensor, rank: int, primary_only: bool) -> list[Chunk]: ...

    def shard_tensor(self, kind: str, full: torch.Tensor, rank: int) -> torch.Tensor: ...

    def write_primary(self, kind: str, local: torch.Tensor, rank: int, full: torch.Tensor) -> None: ...

    def copies_block(self) -> int | None: ...

    def counted_slots(self, rank: int) -> torch.Tensor | None: ...


class PlacedParameter(NamedTuple):
    """How one parameter is split over the ranks, and its kind (``w1``, ``qkv.weight``, ...)."""

    sharding: Sharding
    kind: str


def gather_full(
    tensor: torch.Tensor, placement: Sharding, kind: str, rank: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The full (E, ...) tensor from every rank's part: each writes its primary shards into zeros,
    one all-reduce (a collective: every rank calls it)."""
    full = placement.empty_full(kind, tensor.detach())
    placement.write_primary(kind, tensor.detach(), rank, full)
    if group is not None and placement.world_size > 1:
        all_reduce(full, group)
    return full


def gather_full_state(
    state: Mapping[str, torch.Tensor], placement: ExpertPlacement, rank: int, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """A layer's state with all E experts from every rank's part (a collective over ``group``): its
    expert tensors gathered (:func:`gather_full`), the others copied."""
    full: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        kind = expert_kind(name)
        full[name] = tensor.detach().clone() if kind is None else gather_full(tensor, placement, kind, rank, group)
    return full


def _runs(shards: Sequence[ExpertShard], kept: list[int]) -> list[tuple[int, int]]:
    """(first, last) local indices of the runs in ``kept`` that hold consecutive experts with the
    same hidden slice at consecutive local indices: each run is one chunk of the full tensor."""
    runs: list[tuple[int, int]] = []
    for index in kept:
        if runs:
            first, last = runs[-1]
            previous, shard = shards[last], shards[index]
            if index == last + 1 and shard == ExpertShard(previous.expert + 1, previous.hidden_start,
                                                          previous.hidden_stop):
                runs[-1] = (first, index)
                continue
        runs.append((index, index))
    return runs


def _hidden_slice(expert: torch.Tensor, axis: int | None, shard: ExpertShard) -> torch.Tensor:
    """The shard's view of one expert's tensor (``axis`` counts the expert axis, gone here)."""
    if axis is None:
        return expert
    return expert.narrow(axis - 1, shard.hidden_start, shard.hidden_stop - shard.hidden_start)


def expert_kind(name: str, prefix: str = "experts.") -> str | None:
    """The parameter kind of a state-dict name under ``prefix`` (``experts.w1`` -> ``w1``;
    ``blocks.0.ffn.experts.b2`` -> ``b2``), else None."""
    if not (name.startswith(prefix) or f".{prefix}" in name):
        return None
    kind = name.rsplit(".", 1)[-1]
    return kind if kind in HIDDEN_AXIS else None


def shard_expert_state(
    full_state: Mapping[str, torch.Tensor], placement: ExpertPlacement, rank: int, prefix: str = "experts."
) -> dict[str, torch.Tensor]:
    """Slice a state dict holding all E experts (names under ``prefix``) down to ``rank``'s part of
    ``placement``; other entries are copied."""
    return placement.shard_state(full_state, rank, lambda name: expert_kind(name, prefix))


def expert_parallel_names(placed: Mapping[str, PlacedParameter]) -> set[str]:
    """The names whose ranks hold different experts (not replicated): their gradients already sum
    every rank's tokens, so a trainer does not all-reduce them."""
    return {name for name, (sharding, _) in placed.items()
            if isinstance(sharding, ExpertPlacement) and not sharding.is_replicated}
