"""``moeflow bench alltoall``: linear vs 2DH vs pairwise over message sizes on emulated clusters.

The driver launches one emulated cluster per layout (nodes x ranks per node) and runs this module as
every rank. For each size (bytes each rank sends to each destination) and algorithm, all ranks
synchronize, run one all-to-all, and the slowest rank's time counts; medians over repeats, with the
algorithms interleaved round-robin. Rank 0 prints one JSON object per measurement. The summary gives,
per layout, 2DH's speedup over linear at each size and the crossover: the largest size at which
2DH still wins.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import timedelta
from typing import Any

from moeflow.bench import POINT_DONE
from moeflow.progress import Progress, Quiet

DEFAULT_SIZES = (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
DEFAULT_LAYOUTS = ((2, 2), (4, 2), (1, 4))


def _rank_main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.comm.algorithms import ALGORITHMS, all_to_all_with
    from moeflow.comm.groups import ParallelGroups
    from moeflow.comm.topology import topology_from_environment
    from moeflow.distributed import destroy_process_groups
    from moeflow.timing.measure import slowest_rank_seconds

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = topology_from_environment(os.environ, world)
    groups = ParallelGroups(dist.group.WORLD, topology)
    for size in args.sizes:
        x = torch.zeros(world * max(1, size // 4))
        samples: dict[str, list[float]] = {name: [] for name in ALGORITHMS}
        for round_index in range(args.repeats + 1):  # round 0 warms up connections and buffers
            for name in ALGORITHMS:
                seconds = slowest_rank_seconds(lambda name=name, x=x: all_to_all_with(name, x, groups))
                if round_index:
                    samples[name].append(seconds)
        if rank == 0:
            for name, values in samples.items():
                seconds = statistics.median(values)
                print(json.dumps({
                    "bench": "alltoall", "nodes": topology.num_nodes, "ranks_per_node": topology.ranks_per_node,
                    "algorithm": name, "bytes_per_destination": x.numel() // world * 4,
                    "ms": seconds * 1e3, "send_gbit_per_s_per_rank": x.numel() * 4 * 8 / seconds / 1e9,
                    "latency_emulated": os.environ.get("MOEFLOW_TESTBED_LATENCY_EMULATED") == "1",
                }), flush=True)
            print(POINT_DONE, flush=True)
    destroy_process_groups()


def run(
    layouts: list[tuple[int, int]], sizes: list[int], inter_gbit: float, latency_us: float, repeats: int,
    master_port: int = 29700, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch each layout and return every rank-0 measurement (printed as they arrive);
    ``progress`` counts the (layout, size) points done."""
    from moeflow.bench import RankZeroRecords
    from moeflow.testbed import ClusterSpec, launch

    progress = progress or Quiet()
    progress.expect(len(layouts) * len(sizes))
    results: list[dict[str, Any]] = []
    for index, (nodes, per_node) in enumerate(layouts):
        progress.note(f"{nodes}x{per_node}")
        sink = RankZeroRecords(progress, inter_gbit=inter_gbit, inter_latency_us=latency_us)
        spec = ClusterSpec(nodes, per_node, inter_gbit, latency_us)
        command = [sys.executable, "-m", "moeflow.bench.alltoall", "--sizes", *map(str, sizes),
                   "--repeats", str(repeats)]
        code = launch(spec, command, master_port=master_port + index, timeout_s=600, sink=sink)
        if code:
            raise RuntimeError(f"alltoall benchmark on {nodes}x{per_node} failed (exit {code}):\n{sink.getvalue()}")
        results.extend(sink.records)
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    layouts: dict[str, dict[str, Any]] = {}
    for record in results:
        key = f"{record['nodes']}x{record['ranks_per_node']}"
        layouts.setdefault(key, {}).setdefault(record["bytes_per_destination"], {})[record["algorithm"]] = record["ms"]
    summary: dict[str, Any] = {"summary": "alltoall", "layouts": {}}
    for key, by_size in layouts.items():
        speedups = {size: times["linear"] / times["2dh"] for size, times in sorted(by_size.items())}
        pairwise = {size: times["linear"] / times["pairwise"] for size, times in sorted(by_size.items())}
        wins = [size for size, speedup in speedups.items() if speedup > 1.0]
        summary["layouts"][key] = {
            "2dh_speedup_over_linear": {str(size): round(value, 3) for size, value in speedups.items()},
            "pairwise_speedup_over_linear": {str(size): round(value, 3) for size, value in pairwise.items()},
            "2dh_wins_up_to_bytes": max(wins) if wins else None,
        }
    summary["latency_emulated"] = all(record["latency_emulated"] for record in results) if results else None
    return summary


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
