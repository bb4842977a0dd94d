"""``moeflow bench contention``: all-to-alls against the gradient all-reduce (Lina).

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int
from moeflow.commands.bench.common import (
    add_cluster_layout,
    run_cluster_grid,
)


def add(benches: Any) -> None:
    contention = benches.add_parser(
        "contention", help="MoE all-to-alls against the gradient all-reduce (Lina): alone, beside it, DDP buckets, "
        "Lina's micro-ops; training steps per --grad-sync mode and per expert packing (emulated cluster, needs root)",
        description="links: the backward of --layers MoE layers with --allreduce-mb of gradients to all-reduce, the "
        "median all-to-all per mode. step: training steps of the default and a larger model under --grad-sync after, "
        "overlap and lina, round-robin, the slowest rank's median step time. packing: the same steps under lina with "
        "Lina's expert packing off and at each number of experts per worker its doubling reaches.",
    )
    add_cluster_layout(contention, ranks_per_node=1)
    contention.add_argument("--kinds", nargs="+", default=["links", "step", "packing"],
                            choices=("links", "step", "packing"),
                            help="which measurements to make: links, step, packing (default all)")
    contention.add_argument("--models", nargs="+", default=["default", "large"], choices=("default", "large"),
                            help="step: the trainer's default model and/or a wider one (default both)")
    contention.add_argument("--microop-mb", nargs="+", type=float, default=[1.0],
                            help="Lina's micro-op sizes to measure, in MB (default 1)")
    contention.add_argument("--bucket-mb", type=float, default=1.0,
                            help="megabytes at which a gradient bucket of --grad-sync overlap closes (default 1)")
    contention.add_argument("--alltoall-mb", type=float, default=5.0,
                            help="links: megabytes in each all-to-all's buffer (default 5)")
    contention.add_argument("--allreduce-mb", type=float, default=8.0,
                            help="links: megabytes of gradients to all-reduce (default 8)")
    contention.add_argument("--steps", type=positive_int, default=5, help="step: timed steps per mode (default 5)")
    contention.add_argument("--repeats", type=positive_int, default=5, help="links: timed rounds, medians (default 5)")
    add_progress_flag(contention)
    contention.set_defaults(func=run_contention)


def run_contention(args: argparse.Namespace) -> int:
    from moeflow.bench.contention import ContentionPoint, run, summarize

    if min(args.microop_mb) <= 0 or args.bucket_mb <= 0 or args.alltoall_mb <= 0 or args.allreduce_mb <= 0:
        raise fail("bench contention", "--microop-mb, --bucket-mb, --alltoall-mb and --allreduce-mb must be > 0")
    grid = []
    if "links" in args.kinds:
        grid += [ContentionPoint("links", alltoall_mb=args.alltoall_mb, allreduce_mb=args.allreduce_mb,
                                 microop_mb=size, bucket_mb=args.bucket_mb) for size in args.microop_mb]
    grid += [ContentionPoint(kind, model=model, microop_mb=size, bucket_mb=args.bucket_mb, steps=args.steps)
             for kind in ("step", "packing") if kind in args.kinds for model in args.models for size in args.microop_mb]
    return run_cluster_grid("bench contention", run, summarize, grid, args)
