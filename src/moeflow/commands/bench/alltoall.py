"""``moeflow bench alltoall``: the all-to-all algorithms on the emulated cluster.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, require_testbed, show_progress


def add(benches: Any) -> None:
    alltoall = benches.add_parser(
        "alltoall", help="linear vs 2DH vs pairwise all-to-all on emulated clusters (needs root)",
    )
    alltoall.add_argument("--layouts", nargs="+", default=["2x2", "4x2", "1x4"],
                          help="the emulated clusters to measure, each NODESxRANKS_PER_NODE (default 2x2 4x2 1x4)")
    alltoall.add_argument("--sizes", type=positive_int, nargs="+", default=None,
                          help="message sizes to time, bytes per destination (default 1 KiB .. 1 MiB)")
    alltoall.add_argument("--inter-gbit", type=float, default=1.0, help="bandwidth between nodes, Gbit/s (default 1)")
    alltoall.add_argument("--inter-latency-us", type=float, default=100.0,
                          help="one-way latency between nodes in microseconds (needs sch_netem; recorded when absent; "
                          "default 100)")
    alltoall.add_argument("--repeats", type=positive_int, default=7, help="timed rounds, medians (default 7)")
    add_progress_flag(alltoall)
    alltoall.set_defaults(func=run_alltoall)


def run_alltoall(args: argparse.Namespace) -> int:
    from moeflow.bench.alltoall import DEFAULT_SIZES, run, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar
    from moeflow.testbed import ClusterError

    layouts = []
    for text in args.layouts:
        nodes, _, per_node = text.partition("x")
        if not (nodes.isdigit() and per_node.isdigit() and int(nodes) >= 1 and int(per_node) >= 1):
            raise fail("bench alltoall", f"--layouts takes NODESxRANKS like 2x2, got {text!r}")
        layouts.append((int(nodes), int(per_node)))
    require_testbed("bench alltoall")
    try:
        with progress_bar("bench alltoall", "point", enabled=show_progress(args)) as progress:
            results = run(layouts, list(args.sizes or DEFAULT_SIZES), args.inter_gbit, args.inter_latency_us,
                          args.repeats, progress=progress)
    except (ClusterError, RuntimeError) as error:
        raise fail("bench alltoall", error) from None
    print_json(summarize(results))
    return 0
