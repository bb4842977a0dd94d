"""``moeflow bench lina-inference``: Lina's inference scheduling.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, require_testbed, show_progress
from moeflow.commands.bench.common import (
    add_cluster_layout,
)


def add(benches: Any) -> None:
    parser = benches.add_parser(
        "lina-inference", help="Lina's inference scheduling: static, lina, oracle and ideal batch times (needs root)",
        description="On the emulated cluster, every worker runs batches of sequences under the static placement, "
        "Lina's estimate-then-fine-tune schedule, the oracle (gate counts) and the ideal (a balanced gate), the same "
        "batches for each: median and p95 batch times over ideal's, the estimate's accuracy per layer and the "
        "path-length ablation. Models: a moeflow train checkpoint (--checkpoint) and random Mixtral-like models "
        "with skewed (popular experts spread, or colocated on one worker) and uniform routers.",
    )
    parser.add_argument("--models", nargs="+", default=["trained", "skewed", "colocated", "uniform"],
                        choices=("trained", "skewed", "colocated", "uniform"),
                        help="the models to schedule: trained (needs --checkpoint), skewed, colocated, uniform "
                        "(default all)")
    parser.add_argument("--checkpoint", default=None, help="a moeflow train run folder (the trained model)")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per worker per batch (default 4)")
    parser.add_argument("--context", type=positive_int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batches", type=positive_int, default=20, help="timed batches per schedule (default 20)")
    parser.add_argument("--max-experts-per-rank", type=positive_int, default=8,
                        help="Lina's packing limit (default 8: E=8 on 2 workers leaves room to balance)")
    parser.add_argument("--replica-slots", type=int, default=None, metavar="R",
                        help="a memory budget for lina and oracle: each worker keeps its own experts and computes "
                        "at most R copies of others, made where the calibrated cost model says they pay (the "
                        "cluster is calibrated first unless --profile; default: Lina's packing up to "
                        "--max-experts-per-rank)")
    parser.add_argument("--plot", metavar="PNG",
                        help="write the Fig. 16-style plot of the times over ideal's to this PNG")
    add_cluster_layout(parser, 1)
    add_progress_flag(parser)
    parser.set_defaults(func=run_lina_inference)


def run_lina_inference(args: argparse.Namespace) -> int:
    from moeflow.bench.lina_inference import LinaPoint, run_cluster, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar

    if "trained" in args.models and args.checkpoint is None:
        raise fail("bench lina-inference", "the trained model needs --checkpoint RUN_DIR (a moeflow train run), or "
                   "leave it out: --models skewed uniform")
    require_testbed("bench lina-inference")
    from moeflow.testbed import ClusterError

    points = [LinaPoint(model, args.checkpoint or "", args.batch, args.context, args.batches,
                        max_experts_per_rank=args.max_experts_per_rank, replica_slots=args.replica_slots)
              for model in args.models]
    try:
        with progress_bar("bench lina-inference", "point", enabled=show_progress(args)) as progress:
            records = run_cluster(points, args.nodes, args.ranks_per_node, args.inter_gbit, args.profile,
                                  progress=progress)
    except (ClusterError, RuntimeError) as error:
        raise fail("bench lina-inference", error) from None
    if args.plot:
        from moeflow.bench.lina_plot import plot_lina_inference

        plot_lina_inference(records, args.plot)
    print_json(summarize(records))
    return 0
