"""Lina's popularity-based placement (§5.2, Eq. 1): from a load per expert, replicate the experts
that need more than one rank and pack the others with first-fit decreasing.

Loads are in tokens (estimated or counted); a rank's fair share is total / W. An expert whose
share is above one rank gets round(share) ranks of its own (its tokens split evenly over them);
the rest are packed by first-fit decreasing into bins of one rank's share (the replicas' ranks
first, then the free ranks), at most ``max_experts_per_rank`` per rank. A rank left empty serves
another copy of the expert with the most load per copy; experts with no load (no token expected)
go to the ranks holding the fewest experts. Where rounding leaves too few ranks for the rest, the
replica counts are trimmed one at a time and the option whose busiest rank carries the least load
wins. The answer is a pure function of its inputs, so every rank computes the same placement from
the same gathered loads, with no coordinator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from moeflow.parallel.placement import ExpertPlacement, ExpertShard

MAX_EXPERTS_PER_RANK = 4
"""Lina §7.3: the most experts a device hosts in inference."""
_SLACK = 1e-9  # shares are floats: "fits" tolerates rounding


def check_max_experts_per_rank(max_experts_per_rank: int, num_experts: int, world_size: int) -> None:
    if not isinstance(max_experts_per_rank, int) or max_experts_per_rank < 1:
        raise ValueError(f"max_experts_per_rank must be an integer >= 1, got {max_experts_per_rank!r}")
    if max_experts_per_rank * world_size < num_experts:
        raise ValueError(
            f"max_experts_per_rank={max_experts_per_rank} cannot hold {num_experts} experts on {world_size} ranks; "
            f"use at least {math.ceil(num_experts / world_size)}"
        )


def first_fit_decreasing(
    sizes: Sequence[tuple[int, float]], bins: int, capacity: float, max_items: int,
    opened: Sequence[tuple[int, float]] = (),
) -> list[list[int]]:
    """Pack (item, size) pairs, largest first (ties: lowest item), each into the first open bin
    where it fits in ``capacity`` and ``max_items``, else into a new bin while fewer than ``bins``
    are open, else into the least loaded bin with room. ``opened``: bins already open, one
    (item, size) each. Returns the open bins' items."""
    packed: list[list[int]] = [[item] for item, _ in opened]
    loads: list[float] = [size for _, size in opened]
    for item, size in sorted(sizes, key=lambda pair: (-pair[1], pair[0])):
        fits = [b for b in range(len(packed)) if len(packed[b]) < max_items and loads[b] + size <= capacity + _SLACK]
        if fits:
            target = fits[0]
        elif len(packed) < bins:
            packed.append([])
            loads.append(0.0)
            target = len(packed) - 1
        else:
            room = [b for b in range(len(packed)) if len(packed[b]) < max_items]
            if not room:
                raise ValueError(f"{len(sizes)} items do not fit in {bins} bins of {max_items} items")
            target = min(room, key=lambda b: (loads[b], b))
        packed[target].append(item)
        loads[target] += size
    return packed


def replica_options(share_E: np.ndarray, world_size: int, max_experts_per_rank: int) -> list[dict[int, int]]:
    """Ranks of their own for the experts whose share is above one rank: round(share) each (Lina),
    then with one fewer at a time (from the expert with the least share per rank) while any has
    two or more, every option that leaves a slot for each other expert."""
    big = np.flatnonzero(share_E > 1 + _SLACK).tolist()
    others = len(share_E) - len(big)
    ranks = {e: math.floor(share_E[e] + 0.5) for e in big}
    options = []
    while True:
        used = sum(ranks.values())
        if used <= world_size and used + others <= world_size * max_experts_per_rank:
            options.append(dict(ranks))
        spare = [e for e, n in ranks.items() if n > 1]
        if not spare:
            return options or [{}]
        ranks[min(spare, key=lambda e: (share_E[e] / ranks[e], e))] -= 1


def popularity_assignment(load_E: Sequence[float], world_size: int, max_experts_per_rank: int) -> list[list[int]]:
    """The experts of every rank (sorted) for ``load_E``: Lina's replicate-then-pack rule, with the
    replica counts trimmed where that unloads the busiest rank."""
    load = np.asarray(load_E, dtype=np.float64)
    if world_size == 1:
        return [list(range(len(load)))]
    check_max_experts_per_rank(max_experts_per_rank, len(load), world_size)
    total = float(load.sum())
    share = load * world_size / total if total > 0 else np.zeros(len(load))
    best: list[list[int]] = []
    best_busiest = float("inf")
    for replicas in replica_options(share, world_size, max_experts_per_rank):
        plan = _pack(replicas, share, load, world_size, max_experts_per_rank)
        busiest = max(assignment_loads(plan, load))
        if busiest < best_busiest - _SLACK:
            best, best_busiest = plan, busiest
    return best


def _pack(replicas: dict[int, int], share: np.ndarray, load: np.ndarray, world_size: int,
          max_experts_per_rank: int) -> list[list[int]]:
    """The replicas on ranks of their own, the other loaded experts packed by first-fit decreasing
    beside them or onto the free ranks, then the unloaded ones."""
    opened = [(e, float(share[e]) / replicas[e]) for e in sorted(replicas) for _ in range(replicas[e])]
    small = [(e, float(share[e])) for e in range(len(share)) if share[e] > 0 and e not in replicas]
    ranks = first_fit_decreasing(small, world_size, 1.0, max_experts_per_rank, opened)
    ranks += [[] for _ in range(world_size - len(ranks))]
    unloaded = [e for e in range(len(share)) if share[e] == 0]
    _fill_empty(ranks, load, world_size * max_experts_per_rank - len(unloaded))
    _place_unloaded(unloaded, ranks, max_experts_per_rank)
    return [sorted(experts) for experts in ranks]


def assignment_loads(plan: Sequence[Sequence[int]], load: np.ndarray) -> list[float]:
    """Each rank's load when every expert's splits evenly over its copies."""
    copies = np.zeros(len(load))
    for experts in plan:
        copies[list(experts)] += 1
    return [float(sum(load[e] / copies[e] for e in experts)) for experts in plan]


def _fill_empty(ranks: list[list[int]], load: np.ndarray, slots: int) -> None:
    """An empty rank serves another copy of the expert with the most load per copy, while the
    ``slots`` left for loaded experts allow."""
    copies = np.zeros(len(load))
    for held in ranks:
        copies[held] += 1
    for held in ranks:
        if not held and copies.sum() < slots and load.sum() > 0:
            expert = int(np.argmax(load / np.maximum(copies, 1)))
            held.append(expert)
            copies[expert] += 1


def _place_unloaded(experts: list[int], ranks: list[list[int]], max_items: int) -> None:
    """Experts no token is expected at go to the ranks holding the fewest experts (empty ones
    first; ties: the lowest rank)."""
    for expert in experts:
        room = [r for r, held in enumerate(ranks) if len(held) < max_items]
        ranks[min(room, key=lambda r: (len(ranks[r]), r))].append(expert)


def popularity_placement(
    load_E: Sequence[float], world_size: int, hidden_dim: int, max_experts_per_rank: int = MAX_EXPERTS_PER_RANK
) -> ExpertPlacement:
    """:func:`popularity_assignment` as a placement whose replicated experts split their tokens."""
    assignment = popularity_assignment(load_E, world_size, max_experts_per_rank)
    return assignment_placement(assignment, len(load_E), hidden_dim)


def assignment_placement(plan: Sequence[Sequence[int]], num_experts: int, hidden_dim: int) -> ExpertPlacement:
    """Whole experts on each rank as ``plan`` lists them; an expert on several ranks splits its tokens."""
    shards = tuple(tuple(ExpertShard(e, 0, hidden_dim) for e in experts) for experts in plan)
    return ExpertPlacement(num_experts, hidden_dim, shards, split_tokens=True)


def own_assignment(num_experts: int, world_size: int) -> list[list[int]]:
    """Each rank's own experts, E / W in a row (expert parallel): where the weights are stored."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world_size} ranks")
    own = num_experts // world_size
    return [list(range(rank * own, (rank + 1) * own)) for rank in range(world_size)]


def replica_slot_assignment(
    load_E: Sequence[float], world_size: int, replica_slots: int,
    seconds: Callable[[list[list[int]]], float] | None = None,
) -> list[list[int]]:
    """The experts of every rank under a memory budget: its own E / W experts (expert parallel),
    plus at most ``replica_slots`` copies of others. Greedy, as long as it pays: of the experts
    that can still get a copy, the one with the most load per copy gets one more, on the least
    loaded rank that has a free slot and lacks it, while that lowers the plan's ``seconds`` (a
    cost model's time of the layer under a plan, copies included), or without one the busiest
    rank's load. Loads split evenly over an expert's copies. Owners never change, so only the
    copies' weights move."""
    load = np.asarray(load_E, dtype=np.float64)
    if not isinstance(replica_slots, int) or replica_slots < 0:
        raise ValueError(f"replica_slots must be an integer >= 0, got {replica_slots!r}")
    plan = own_assignment(len(load), world_size)
    if replica_slots == 0:
        return plan
    limit = len(plan[0]) + replica_slots
    price = seconds if seconds is not None else (lambda trial: max(assignment_loads(trial, load)))
    best = price(plan)
    copies = np.ones(len(load))
    while True:
        loads = assignment_loads(plan, load)
        movable = [e for e in range(len(load)) if load[e] > 0 and any(
            len(held) < limit and e not in held for held in plan)]
        if not movable:
            break
        expert = min(movable, key=lambda e: (-load[e] / copies[e], e))  # one try: the most load per copy
        room = [r for r in range(world_size) if len(plan[r]) < limit and expert not in plan[r]]
        target = min(room, key=lambda r: (loads[r], r))
        trial = [[*held, expert] if r == target else held for r, held in enumerate(plan)]
        trial_price = price(trial)
        if trial_price >= best - _SLACK * max(1.0, abs(best)):
            break
        plan, best = trial, trial_price
        copies[expert] += 1
    return [sorted(experts) for experts in plan]
