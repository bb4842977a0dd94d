"""``moeflow bench parallel``: Tutel's r and Parm's schedules.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, add_renamed_flag, positive_int
from moeflow.commands.bench.common import (
    add_cluster_layout,
    run_cluster_grid,
)


def add(benches: Any) -> None:
    parallel = benches.add_parser(
        "parallel", help="every fixed Tutel r vs the planner's per-iteration choice on an emulated cluster "
        "(needs root)",
        description="Grid: --num-experts x --hidden-dims x --capacity-factors at --tokens tokens per rank (one MoE "
        "layer). Without --profile the ranks calibrate the cluster first.",
    )
    add_cluster_layout(parallel, ranks_per_node=1)
    parallel.add_argument("--num-experts", type=positive_int, nargs="+", default=[1, 2],
                          help="numbers of experts E to try; W > E shards each expert's hidden dimension (default 1 2)")
    add_renamed_flag(parallel, "--experts", "--num-experts", type=positive_int, nargs="+")
    parallel.add_argument("--hidden-dims", type=positive_int, nargs="+", default=[256, 2048],
                          help="expert hidden sizes H to try (default 256 2048: two expert sizes, as Tutel Fig. 12)")
    parallel.add_argument("--capacity-factors", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0],
                          help="capacity factors f to try (default 1 2 4 8)")
    parallel.add_argument("--tokens", type=positive_int, default=512, help="tokens per rank (default 512)")
    parallel.add_argument("--model-dim", type=positive_int, default=256, help="model dimension M (default 256)")
    parallel.add_argument("--mp", type=positive_int, default=1,
                          help="> 1: Parm's S1, S2, S2+SAA and auto against the DeepSpeed-MoE baseline behind MP "
                          "attention of this many ranks (N_ESP = N_MP) instead of Tutel's r")
    parallel.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per mode (default 5)")
    add_progress_flag(parallel)
    parallel.set_defaults(func=run_parallel)


def run_parallel(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench.parallel import ParallelPoint, run, summarize

    grid = [ParallelPoint(e, h, f, args.tokens, args.model_dim, mp=args.mp)
            for e, h, f in itertools.product(args.num_experts, args.hidden_dims, args.capacity_factors)]
    return run_cluster_grid("bench parallel", run, summarize, grid, args)
