"""Link probe, run as the ranks of a launched cluster: round-trip latency and one-way bandwidth of
the intra-node link (rank 0 <-> 1) and the inter-node link (rank 0 <-> first rank of node 1), over
gloo send/recv. Rank 0 prints one JSON object."""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moeflow.comm.collectives import barrier, receive, send
from moeflow.distributed import destroy_process_groups

SMALL_ROUND_TRIPS = 20
LARGE_BYTES = 16 << 20


def _measure(peer: int, me: int, initiator: bool) -> dict[str, float]:
    small = torch.zeros(1)
    large = torch.zeros(LARGE_BYTES // 4)
    round_trips = []
    for _ in range(SMALL_ROUND_TRIPS):
        start = time.perf_counter()
        if initiator:
            send(small, peer)
            receive(small, peer)
        else:
            receive(small, peer)
            send(small, peer)
        round_trips.append(time.perf_counter() - start)
    start = time.perf_counter()
    if initiator:
        send(large, peer)
        receive(small, peer)  # the receiver's acknowledgement closes the timing
    else:
        receive(large, peer)
        send(small, peer)
    seconds = time.perf_counter() - start
    return {"round_trip_us": statistics.median(round_trips) * 1e6, "gbit_per_s": LARGE_BYTES * 8 / seconds / 1e9}


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    result: dict[str, object] = {
        "world_size": world, "ranks_per_node": per_node,
        "latency_emulated": os.environ.get("MOEFLOW_TESTBED_LATENCY_EMULATED") == "1",
    }
    pairs = {"intra_node": 1 if per_node > 1 else None, "inter_node": per_node if world > per_node else None}
    for name, peer in pairs.items():
        if peer is None:
            continue
        if rank in (0, peer):
            result[name] = _measure(peer if rank == 0 else 0, rank, initiator=rank == 0)
        barrier()
    if rank == 0:
        print(json.dumps(result), flush=True)
    destroy_process_groups()


if __name__ == "__main__":
    main()
