"""How many replicas each expert gets, and how a replicated expert's tokens split over its replicas.

Formulas on numbers, shared by what runs and what prices it: EPLB's slots
(:mod:`moeflow.parallel.redundant`), the balance choice's cost model (:mod:`moeflow.perf.balance`)
and the simulator; Lina's per-forward placement (:mod:`moeflow.parallel.dynamic`) splits evenly,
as its scheduler prices it.

The split is proportional, not even: each expert held once loads its rank with all its tokens;
then each replicated expert, hottest first, fills its replicas' ranks up to a common level (water
filling), so that a replica on a rank that already holds a hot expert takes fewer tokens. On equal
ranks that is the even split. The tokens of all ranks, in rank order, then go to the replicas in
rank order as contiguous runs of those sizes, so that a sender's tokens stay on a replica of its
own rank where the run allows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def replica_counts(load_E: Sequence[float], num_slots: int, max_per_expert: int) -> list[int]:
    """How many slots each expert gets: one each, then the next slot to the expert with the highest
    load per replica (ties: lowest id), up to ``max_per_expert`` copies while any expert is below."""
    load = np.asarray(load_E, dtype=np.float64)
    counts = np.ones(len(load), dtype=np.int64)
    for _ in range(num_slots - len(load)):
        per_replica = load / counts
        open_ = counts < max_per_expert
        pick = int(np.argmax(np.where(open_, per_replica, -np.inf) if open_.any() else per_replica))
        counts[pick] += 1
    return counts.tolist()


def _pack(items: list[tuple[float, int]], bins: int, room: int) -> list[list[tuple[float, int]]]:
    """Greedy longest-first packing of (load, expert) items into ``bins`` of ``room`` items each:
    each item onto the lightest bin with room that does not hold its expert yet (else any with room)."""
    packed: list[list[tuple[float, int]]] = [[] for _ in range(bins)]
    totals = [0.0] * bins
    for load, expert in sorted(items, key=lambda item: (-item[0], item[1])):
        open_bins = [b for b in range(bins) if len(packed[b]) < room]
        fresh = [b for b in open_bins if all(e != expert for _, e in packed[b])] or open_bins
        target = min(fresh, key=lambda b: (totals[b], b))
        packed[target].append((load, expert))
        totals[target] += load
    return packed


def balanced_slots(
    load_E: Sequence[float], slots_per_rank: int, world_size: int, ranks_per_node: int
) -> list[list[int]]:
    """EPLB's hierarchical placement: the experts of each rank's ``slots_per_rank`` slots. Replica
    counts first (:func:`replica_counts`), then the replicas packed over the nodes (equal slots per
    node, heaviest first onto the lightest node), then over each node's ranks the same way."""
    counts = replica_counts(load_E, slots_per_rank * world_size, max_per_expert=world_size)
    items = [(float(load_E[e]) / counts[e], e) for e in range(len(load_E)) for _ in range(counts[e])]
    ranks: list[list[int]] = []
    for node_items in _pack(items, world_size // ranks_per_node, slots_per_rank * ranks_per_node):
        ranks += [sorted(e for _, e in rank_items) for rank_items in _pack(node_items, ranks_per_node, slots_per_rank)]
    return ranks


def water_fill(total: int, level_R: np.ndarray) -> np.ndarray:
    """``total`` whole tokens over R bins that already hold ``level_R``: each bin filled up to one
    common level, the rounding remainder to the lowest bins first (ties: lowest index)."""
    bins = len(level_R)
    order = np.argsort(level_R, kind="stable")
    levels = level_R[order].astype(np.float64)
    share = np.zeros(bins)
    for count in range(bins, 0, -1):  # the level reached when the lowest ``count`` bins take everything
        level = (total + levels[:count].sum()) / count
        if count == 1 or level >= levels[count - 1]:
            share[:count] = np.maximum(level - levels[:count], 0.0)
            break
    whole = np.floor(share).astype(np.int64)
    remainder = total - int(whole.sum())
    if remainder:
        fractions = share - whole
        whole[np.argsort(-fractions, kind="stable")[:remainder]] += 1
    out = np.zeros(bins, dtype=np.int64)
    out[order] = whole
    return out


def replica_shares(tokens_E: np.ndarray, slot_experts: Sequence[int], slot_ranks: Sequence[int]) -> np.ndarray:
    """(P,) tokens each slot computes: an expert held once takes all of its tokens; replicated
    experts, hottest first, are water-filled over their replicas' ranks (two replicas on one rank
    share its bin evenly)."""
    tokens = np.asarray(tokens_E, dtype=np.int64)
    slot_experts, slot_rank = np.asarray(slot_experts), np.asarray(slot_ranks)
    copies = np.bincount(slot_experts, minlength=len(tokens))
    shares = np.where(copies[slot_experts] == 1, tokens[slot_experts], 0).astype(np.int64)
    rank_load = np.bincount(slot_rank, weights=shares).astype(np.int64)
    for expert in sorted(np.flatnonzero(copies > 1).tolist(), key=lambda e: (-int(tokens[e]), e)):
        slots = np.flatnonzero(slot_experts == expert)
        ranks = np.unique(slot_rank[slots])
        per_rank = water_fill(int(tokens[expert]), rank_load[ranks])
        rank_load[ranks] += per_rank
        for rank, amount in zip(ranks.tolist(), per_rank.tolist(), strict=True):
            mine = slots[slot_rank[slots] == rank]
            shares[mine] = amount // len(mine) + (np.arange(len(mine)) < amount % len(mine))
    return shares


def split_runs(counts_W: np.ndarray, shares: Sequence[int], replicas: Sequence[int], starts: np.ndarray,
               lengths: np.ndarray) -> None:
    """Split one expert's tokens (all ranks in rank order) into contiguous runs of ``shares`` tokens,
    one per replica slot in ``replicas`` (rank order), writing each sender's run into
    ``starts[source, slot]`` and ``lengths[source, slot]``."""
    bounds = np.concatenate([[0], np.cumsum(shares)]).tolist()
    offset = 0
    for source, count in enumerate(np.asarray(counts_W).tolist()):
        for j, slot in enumerate(replicas):
            first, last = max(offset, bounds[j]), min(offset + count, bounds[j + 1])
            if last > first:
                starts[source, slot], lengths[source, slot] = first - offset, last - first
        offset += count


def even_shares(tokens_E: np.ndarray, slot_experts: Sequence[int]) -> np.ndarray:
    """(P,) tokens each slot computes when every expert's tokens split evenly over its replicas
    (the earlier in rank order take the remainder)."""
    tokens, slot_experts = np.asarray(tokens_E, dtype=np.int64), np.asarray(slot_experts)
    shares = np.zeros(len(slot_experts), dtype=np.int64)
    for expert in np.unique(slot_experts).tolist():
        slots = np.flatnonzero(slot_experts == expert)
        bounds = [j * int(tokens[expert]) // len(slots) for j in range(len(slots) + 1)]
        shares[slots] = np.diff(bounds)
    return shares


def slot_split(
    tokens_WE: np.ndarray, slot_experts: Sequence[int], slot_ranks: Sequence[int], proportional: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """(starts_WP, lengths_WP): where each sender's run of each slot's expert begins among the
    sender's tokens of that expert, and how long it is (:func:`replica_shares` sizes the runs, or
    :func:`even_shares` where not ``proportional``)."""
    tokens = np.asarray(tokens_WE, dtype=np.int64)
    slot_experts = np.asarray(slot_experts)
    starts = np.zeros((tokens.shape[0], len(slot_experts)), dtype=np.int64)
    lengths = np.zeros_like(starts)
    shares = replica_shares(tokens.sum(0), slot_experts, slot_ranks) if proportional else \
        even_shares(tokens.sum(0), slot_experts)
    for expert in range(tokens.shape[1]):
        replicas = np.flatnonzero(slot_experts == expert)
        split_runs(tokens[:, expert], shares[replicas].tolist(), replicas.tolist(), starts, lengths)
    return starts, lengths
