"""``moeflow bench pipeline``: pipeline degrees against degree 1 on the emulated cluster.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, positive_int
from moeflow.commands.bench.common import (
    add_cluster_layout,
    run_cluster_grid,
)


def add(benches: Any) -> None:
    pipeline = benches.add_parser(
        "pipeline", help="fixed pipeline degrees and all-to-alls vs the planner on an emulated cluster (needs root)",
        description="Grid: the product of the list options (default 32 configurations, from communication-bound "
        "H=256 to computation-bound H=1024 at 1 Gbit/s). Without --profile the ranks calibrate the cluster first.",
    )
    add_cluster_layout(pipeline, ranks_per_node=2)
    pipeline.add_argument("--tokens", type=positive_int, nargs="+", default=[512, 1024],
                          help="tokens per rank to try (default 512 1024)")
    pipeline.add_argument("--model-dims", type=positive_int, nargs="+", default=[256, 512],
                          help="model dimensions M to try (default 256 512)")
    pipeline.add_argument("--hidden-dims", type=positive_int, nargs="+", default=[256, 1024],
                          help="expert hidden sizes H to try (default 256 1024)")
    pipeline.add_argument("--experts-per-rank", type=positive_int, nargs="+", default=[1, 2],
                          help="experts on each rank to try (default 1 2)")
    pipeline.add_argument("--top-k", type=positive_int, nargs="+", default=[1, 2],
                          help="experts per token k to try (default 1 2)")
    pipeline.add_argument("--repeats", type=positive_int, default=3, help="timed rounds, medians (default 3)")
    add_progress_flag(pipeline)
    pipeline.set_defaults(func=run_pipeline)


def run_pipeline(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench.pipeline import GridPoint, run, summarize

    grid = [GridPoint(*values) for values in itertools.product(
        args.tokens, args.model_dims, args.hidden_dims, args.experts_per_rank, args.top_k)]
    return run_cluster_grid("bench pipeline", run, summarize, grid, args)
