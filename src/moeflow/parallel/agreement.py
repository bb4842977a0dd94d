"""The load agreement: one small all-gather per forward, before capacity, by which every rank learns
every rank's routing counts (capacity and the exchange's splits must agree).

The same buffer carries what the dispatchers need agreed with it: each rank's token count, whether
it asks for a direct path (a no-grad forward: grad mode is each rank's own), an inference hook's
estimate of the selections ahead (Lina), and at decode sizes the tokens themselves, so that the
gathered dispatcher (:mod:`moeflow.parallel.dispatchers.gathered`) needs no collective of its own.

An all-gather needs one size on every rank, and no rank knows the others' token counts
beforehand. The buffer carries :func:`bucket_after` tokens: the largest rank's count of the layer's
previous gathered forward, which every rank holds alike (a decode step repeats its batch). A rank
with more tokens than the bucket sends only its counts; every rank sees that in the counts and the
forward goes on by another dispatcher, with no further collective for the load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.comm.collectives import all_gather_into
from moeflow.comm.groups import ParallelGroups
from moeflow.core.capacity import expert_capacity
from moeflow.core.device_copy import to_device

GATHER_TOKENS = 8
"""The most tokens per rank the load all-gather carries (decode batches). Above it, a rank's tokens
would cost every other rank their bytes (an all-gather sends each token to all W ranks)."""


@dataclass(frozen=True)
class GlobalLoad:
    """Routing counts of every rank, agreed once per forward."""

    counts_WE: torch.Tensor  # assignments each rank routes to each expert
    max_tokens_per_rank: int
    estimate_E: np.ndarray | None = None  # an inference hook's estimated selections, summed over ranks

    @property
    def needed_capacity(self) -> int:
        return int(self.counts_WE.max()) if self.counts_WE.numel() else 0

    def capacity(self, capacity_factor: float, top_k: int) -> int:
        """The slots per expert per rank this load gets (the same on every rank)."""
        return expert_capacity(capacity_factor, top_k, self.max_tokens_per_rank, self.counts_WE.shape[1],
                               self.needed_capacity)


@dataclass(frozen=True)
class CarriedTokens:
    """This rank's tokens and choices, for the agreement to carry in ``bucket`` rows per rank."""

    x_TM: torch.Tensor
    expert_idx_TK: torch.Tensor
    weights_TK: torch.Tensor
    bucket: int


@dataclass(frozen=True)
class GatheredTokens:
    """Every rank's tokens of one forward, padded to the bucket: rank s's first ``tokens_W[s]`` rows."""

    tokens_W: list[int]
    x_WBM: torch.Tensor
    expert_idx_WBK: torch.Tensor
    weights_WBK: torch.Tensor

    @property
    def padded(self) -> bool:
        """Some rank had fewer tokens than the bucket: its padding rows (zeros, expert 0) must be
        neither computed nor sent back."""
        return min(self.tokens_W) < self.x_WBM.shape[1]

    def real_WB(self) -> torch.Tensor:
        """Which of the (W, bucket) rows hold a token, on the tokens' device."""
        real = torch.arange(self.x_WBM.shape[1]) < torch.tensor(self.tokens_W).unsqueeze(1)
        return to_device(real, self.x_WBM.device)


@dataclass(frozen=True)
class Agreement:
    """What the all-gather brought: every rank's load, whether every rank asked for a direct path,
    and every rank's tokens where all asked and each rank's fit the bucket."""

    load: GlobalLoad
    all_direct: bool = False
    tokens: GatheredTokens | None = None


def bucket_after(load: GlobalLoad) -> int:
    """The tokens per rank the layer's next load all-gather carries: this forward's largest rank, if
    at most :data:`GATHER_TOKENS` (the same on every rank: it comes from the gathered counts)."""
    return load.max_tokens_per_rank if load.max_tokens_per_rank <= GATHER_TOKENS else 0


def agree_load(
    counts_E: torch.Tensor, num_tokens: int, groups: ParallelGroups, estimate_E: np.ndarray | None = None,
    asks_direct: bool = False, carried: CarriedTokens | None = None,
) -> Agreement:
    """All-gather every rank's counts and token count, whether it asks for a direct path, and an
    inference hook's ``estimate_E`` or, where it asks and has at most ``carried.bucket`` tokens, its
    tokens (every rank passes the same bucket, and the same kind of payload). One float buffer
    carries it all: fp64 without tokens (counts and the estimate exact); with tokens at least fp32,
    which holds x's dtype without loss and the counts and expert indices exactly below 2**24. On one
    process no collective runs: the counts go to the host once (the sync capacity needs)."""
    if groups.expert is None:
        counts_E = counts_E.cpu()
        estimate = None if estimate_E is None else np.array(estimate_E, dtype=np.float64)
        return Agreement(GlobalLoad(counts_E.unsqueeze(0), num_tokens, estimate), asks_direct)
    experts = counts_E.shape[0]
    bucket = 0 if carried is None else carried.bucket
    estimate = None if estimate_E is None else torch.from_numpy(np.asarray(estimate_E, dtype=np.float64))
    extra = [] if estimate is None else [estimate.numel()]
    header = experts + (1 if carried is None else 2)  # the row paths' ask for a direct path, after the count
    sizes = [header, *extra] + ([] if not bucket else _token_sizes(carried))
    dtype = torch.promote_types(carried.x_TM.dtype, torch.float32) if bucket else torch.float64
    local = torch.zeros(sum(sizes), dtype=dtype, device=counts_E.device)
    row, *fields = local.split(sizes)
    row[:experts] = counts_E
    row[experts:] = torch.tensor([num_tokens, int(asks_direct)][:header - experts], dtype=dtype)
    if estimate is not None:
        fields.pop(0).copy_(estimate)
    if carried is not None and asks_direct and 0 < num_tokens <= bucket:
        for field, values in zip(fields, (carried.expert_idx_TK, carried.weights_TK, carried.x_TM), strict=True):
            field[:values.numel()] = values.flatten()
    every = local.new_empty(groups.size * local.numel())
    with groups.ledger.tracked("load all-gather", groups.expert, local.numel() * local.element_size()):
        all_gather_into(every, local, groups.expert)
    gathered = every.view(groups.size, -1) if bucket else every.view(groups.size, -1).cpu()  # one copy to the host
    return _agreement(gathered.split(sizes, dim=1), counts_E, estimate_E is not None, carried)


def _token_sizes(carried: CarriedTokens) -> list[int]:
    k, model_dim = carried.expert_idx_TK.shape[1], carried.x_TM.shape[1]
    return [carried.bucket * k, carried.bucket * k, carried.bucket * model_dim]


def _agreement(
    parts: tuple[torch.Tensor, ...], counts_E: torch.Tensor, estimated: bool, carried: CarriedTokens | None
) -> Agreement:
    """The gathered buffer, read back: the header on the host, the tokens where every rank's fit."""
    header_WE, *fields = parts
    experts = counts_E.shape[0]
    estimate = fields.pop(0).sum(0).numpy() if estimated else None  # no tokens ride beside an estimate
    header_WE = header_WE.cpu().long()
    load = GlobalLoad(header_WE[:, :experts].to(counts_E.dtype), int(header_WE[:, experts].max()), estimate)
    all_direct = carried is not None and bool(header_WE[:, experts + 1].all())
    if carried is None or not carried.bucket or not all_direct or load.max_tokens_per_rank > carried.bucket:
        return Agreement(load, all_direct)
    world, bucket = header_WE.shape[0], carried.bucket
    k, model_dim = carried.expert_idx_TK.shape[1], carried.x_TM.shape[1]
    return Agreement(load, all_direct, GatheredTokens(
        header_WE[:, experts].tolist(), fields[2].view(world, bucket, model_dim).to(carried.x_TM.dtype),
        fields[0].view(world, bucket, k).long(), fields[1].view(world, bucket, k)))
