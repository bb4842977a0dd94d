"""Tensor-parallel (MP) attention's parameter layouts: each member of an MP group of N ranks holds
heads / N of the heads. :class:`HeadShards` is moeflow's own model's (Megatron: the QKV projection
split by output rows, the output projection by input columns; its bias whole, added once after the
sum); :class:`BlockShards` a transformers model's (``--hf``), one axis of a projection in N blocks.

Both answer what checkpoints and initialization ask of a placement (the full shape, this rank's
slice, the primary copy), so a checkpoint keeps the full tensors under their usual names and loads
into any MP size that divides the heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.parallel.placement import Chunk

TENSOR_PARALLEL_KINDS = ("qkv.weight", "qkv.bias", "proj.weight")
"""The attention tensors that are split over the MP group (``proj.bias`` stays whole)."""


@dataclass(frozen=True)
class MemberShards:
    """What every tensor-parallel layout shares: ``world_size`` ranks in MP groups of ``mp_size``
    consecutive ranks, rank r holding member r % mp_size's part; the ranks with r // mp_size == 0
    hold the primary copies (the others are data-parallel replicas, which average their gradients:
    the trainer's own rule)."""

    world_size: int
    mp_size: int

    @property
    def is_replicated(self) -> bool:
        return False

    def holds_primary(self, rank: int) -> bool:
        return rank // self.mp_size == 0

    def full_shape(self, kind: str, local: torch.Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    def empty_full(self, kind: str, local: torch.Tensor) -> torch.Tensor:
        return local.new_zeros(self.full_shape(kind, local))

    def copies_block(self) -> int | None:
        return None

    def counted_slots(self, rank: int) -> torch.Tensor | None:
        return None


@dataclass(frozen=True)
class HeadShards(MemberShards):
    """moeflow's own attention: member r % mp_size holds head block r % mp_size of QKV (three row
    blocks) and of the output projection (a column block)."""

    model_dim: int

    def _block(self, kind: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """A view of ``full``: the part member ``rank % mp_size`` holds."""
        n, m = self.mp_size, self.model_dim
        member = rank % n
        if kind == "proj.weight":
            return full.view(m, n, m // n)[:, member]
        if kind in ("qkv.weight", "qkv.bias"):
            return full.view(3, n, m // n, *full.shape[1:])[:, member]
        raise ValueError(f"{kind!r} is not split over the MP group (those are {TENSOR_PARALLEL_KINDS})")

    def full_shape(self, kind: str, local: torch.Tensor) -> tuple[int, ...]:
        if kind == "proj.weight":
            return (self.model_dim, self.model_dim)
        return (3 * self.model_dim, *local.shape[1:])

    def shard_tensor(self, kind: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        if tuple(full.shape[:2]) != self.full_shape(kind, full)[:2]:
            raise ValueError(f"{kind} has shape {tuple(full.shape)}, not the model's (model_dim={self.model_dim})")
        block = self._block(kind, full, rank)
        return block.reshape(-1, *block.shape[2:]) if kind != "proj.weight" else block.contiguous()

    def chunks(self, kind: str, local: torch.Tensor, rank: int, primary_only: bool) -> list[Chunk]:
        """This rank's heads as chunks of the full tensor: the output projection's column block, or
        QKV's three row blocks (one each of Q, K and V). ``primary_only``: none on a replica."""
        if primary_only and not self.holds_primary(rank):
            return []
        width = self.model_dim // self.mp_size
        start = rank % self.mp_size * width
        if kind == "proj.weight":
            return [Chunk((0, start), local)]
        trailing = (0,) * (local.dim() - 1)
        return [Chunk((part * self.model_dim + start, *trailing), local[part * width : (part + 1) * width])
                for part in range(3)]

    def write_primary(self, kind: str, local: torch.Tensor, rank: int, full: torch.Tensor) -> None:
        """Write this rank's block into ``full`` if it holds the primary copy (a sum over all
        ranks then assembles the tensor)."""
        if self.holds_primary(rank):
            block = self._block(kind, full, rank)
            block.copy_(local.reshape(block.shape))


@dataclass(frozen=True)
class BlockShards(MemberShards):
    """One axis of a tensor split into ``mp_size`` contiguous blocks (a transformers model's
    attention projection split by heads): member r % mp_size holds block r % mp_size."""

    axis: int
    full_size: int

    def _span(self, rank: int) -> tuple[int, int]:
        """(start, width) of rank's block along the axis."""
        width = self.full_size // self.mp_size
        return rank % self.mp_size * width, width

    def full_shape(self, kind: str, local: torch.Tensor) -> tuple[int, ...]:
        shape = list(local.shape)
        shape[self.axis] = self.full_size
        return tuple(shape)

    def shard_tensor(self, kind: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of rank's block of the full tensor."""
        if full.shape[self.axis] != self.full_size or self.full_size % self.mp_size:
            raise ValueError(f"{kind} has {full.shape[self.axis]} along axis {self.axis}, not {self.full_size} "
                             f"split into {self.mp_size} equal blocks")
        return full.narrow(self.axis, *self._span(rank)).clone()

    def chunks(self, kind: str, local: torch.Tensor, rank: int, primary_only: bool) -> list[Chunk]:
        """This rank's block as one chunk of the full tensor (none on a replica if ``primary_only``)."""
        if primary_only and not self.holds_primary(rank):
            return []
        offsets = [0] * local.dim()
        offsets[self.axis] = self._span(rank)[0]
        return [Chunk(tuple(offsets), local)]

    def write_primary(self, kind: str, local: torch.Tensor, rank: int, full: torch.Tensor) -> None:
        """Write rank's block into ``full`` if it holds the primary copy (a sum over all ranks then
        assembles the tensor)."""
        if self.holds_primary(rank):
            full.narrow(self.axis, *self._span(rank)).copy_(local)
