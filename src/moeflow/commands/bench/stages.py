"""``moeflow bench stages``: the pipeline schedules side by side on the emulated cluster, DualPipeV
with and without its overlap.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench.stages`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, positive_int
from moeflow.commands.bench.common import add_cluster_layout, run_cluster_grid


def add(benches: Any) -> None:
    stages = benches.add_parser(
        "stages", help="pipeline schedules side by side, DualPipeV with and without its overlap, on an emulated "
        "cluster (needs root)",
        description="One pipeline (pp = --ranks-per-node stages, each stage's experts over the --nodes nodes) per "
        "schedule, timed round-robin: gpipe, 1f1b, interleaved, zbv, dualpipev and dualpipev with the overlap of "
        "one micro-batch's all-to-alls with another's compute. The defaults are the recorded run's "
        "(docs/benchmarks): communication-heavy at 1 Gbit/s.",
    )
    add_cluster_layout(stages, ranks_per_node=2)
    stages.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (default 4)")
    stages.add_argument("--model-dim", type=positive_int, default=64, help="model dimension M (default 64)")
    stages.add_argument("--hidden-dim", type=positive_int, default=64, help="expert hidden size H (default 64)")
    stages.add_argument("--experts", type=positive_int, default=4, help="experts per MoE layer (default 4)")
    stages.add_argument("--top-k", type=positive_int, default=4, help="experts per token k (default 4)")
    stages.add_argument("--context", type=positive_int, default=128, help="tokens per sequence (default 128)")
    stages.add_argument("--batch", type=positive_int, default=64,
                        help="sequences a step on each expert-parallel rank (default 64)")
    stages.add_argument("--microbatches", type=positive_int, default=8,
                        help="micro-batches a step; they divide --batch (default 8)")
    stages.add_argument("--repeats", type=positive_int, default=5, help="timed rounds, medians (default 5)")
    add_progress_flag(stages)
    stages.set_defaults(func=run_stages)


def run_stages(args: argparse.Namespace) -> int:
    from moeflow.bench.stages import StagePoint, run, summarize
    from moeflow.commands import fail

    if args.batch % args.microbatches:
        raise fail("bench stages", f"--batch {args.batch} does not split into --microbatches {args.microbatches}: "
                   "choose a batch the micro-batch count divides")
    if args.microbatches < 2 * args.ranks_per_node:  # the V schedules take at least one per stage
        raise fail("bench stages", f"--microbatches {args.microbatches} is fewer than the V schedules' "
                   f"{2 * args.ranks_per_node} stages: use at least that many")
    if args.layers % (2 * args.ranks_per_node):
        raise fail("bench stages", f"--layers {args.layers} does not split into the V schedules' "
                   f"{2 * args.ranks_per_node} stages: use a multiple of {2 * args.ranks_per_node}")
    point = StagePoint(layers=args.layers, model_dim=args.model_dim, hidden_dim=args.hidden_dim,
                       experts=args.experts, top_k=args.top_k, heads=2, context=args.context, batch=args.batch,
                       microbatches=args.microbatches)
    return run_cluster_grid("bench stages", run, summarize, [point], args)
