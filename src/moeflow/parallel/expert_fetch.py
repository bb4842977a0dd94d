"""Moving experts' weights between ranks for one forward (Lina's replicas, §5.2 and §6.2).

Each rank stores its own experts; a placement that computes an expert on a rank that does not
store it fetches the expert's weights from the first rank that stores it, by point-to-point
messages on the expert group's communicator. The messages are posted at once and waited on only
before the experts compute, so a fetch started one layer ahead (Lina's phase 1) runs while that
layer computes; the receive buffers are freed with the forward, so no rank ever holds more than
its own experts and the copies of the layers in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moeflow.comm.collectives import send_and_receive
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.ledger import tracked
from moeflow.core.experts import FFNWeights
from moeflow.parallel.placement import ExpertPlacement


def fetches(storage: ExpertPlacement, placement: ExpertPlacement) -> dict[tuple[int, int], list[int]]:
    """(source, destination) -> the experts that destination computes under ``placement`` but does not
    store, each from the first rank that stores it; every rank derives the same from the two."""
    plan: dict[tuple[int, int], list[int]] = {}
    for rank, shards in enumerate(placement.shards):
        for shard in shards:
            holders = storage.holders(shard.expert)
            if rank not in holders:
                plan.setdefault((holders[0], rank), []).append(shard.expert)
    return plan


@dataclass
class ExpertFetch:
    """The weights of the experts one rank computes under ``placement``: views of the stored ones
    and receive buffers for the copies, filled by point-to-point messages already posted (so a
    fetch started one layer ahead runs while that layer computes); :meth:`wait` completes them."""

    placement: ExpertPlacement
    weights: dict[int, FFNWeights]  # expert -> its (1, ...) weights, stored here or being received
    requests: list[dist.Work] = field(default_factory=list)
    copies: int = 0  # experts fetched by any rank for this placement
    nbytes: int = 0  # bytes this rank sends and receives
    groups: ParallelGroups | None = None

    def wait(self) -> dict[int, FFNWeights]:
        """The weights, once every message of this fetch has arrived (a no-op after the first call)."""
        if self.requests:
            group = None if self.groups is None else self.groups.expert
            with tracked(None if self.groups is None else self.groups.ledger, "expert fetch", group, self.nbytes):
                for request in self.requests:
                    request.wait()
            self.requests = []
        return self.weights


def start_fetch(
    stored: FFNWeights, storage: ExpertPlacement, placement: ExpertPlacement, rank: int,
    groups: ParallelGroups | None,
) -> ExpertFetch:
    """Post the messages that bring ``rank`` the experts it computes under ``placement`` and does
    not store (a collective over the expert group: every rank calls it with the same placements;
    the messages go on the group's communicator, which the layer's exchanges have set up). Returns
    at once; :meth:`ExpertFetch.wait` before computing."""
    local_index = {shard.expert: index for index, shard in enumerate(storage.local(rank))}
    tensors = stored.as_tuple()
    weights = {e: FFNWeights(*(None if t is None else t[i: i + 1] for t in tensors))
               for e, i in local_index.items() if any(s.expert == e for s in placement.local(rank))}
    group = None if groups is None else groups.expert
    sends: list[tuple[torch.Tensor, int]] = []
    receives: list[tuple[torch.Tensor, int]] = []
    planned = sorted(fetches(storage, placement).items())
    for (source, destination), experts in planned:
        for expert in experts:
            if source == rank:
                sends += [(t[local_index[expert]], _global(groups, destination)) for t in tensors if t is not None]
            elif destination == rank:
                received = tuple(None if t is None else t.new_empty(t.shape[1:]) for t in tensors)
                receives += [(t, _global(groups, source)) for t in received if t is not None]
                weights[expert] = FFNWeights(*(None if t is None else t.unsqueeze(0) for t in received))
    requests = send_and_receive(sends, receives, group)
    return ExpertFetch(placement, weights, requests, sum(len(e) for _, e in planned),
                       sum(t.numel() * t.element_size() for t, _ in (*sends, *receives)), groups)


def _global(groups: ParallelGroups | None, rank: int) -> int:
    return rank if groups is None else groups.global_rank(rank)
