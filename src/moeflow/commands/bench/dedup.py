"""``moeflow bench dedup``: the dedup token exchange against the ragged one on an emulated cluster.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench.dedup`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int
from moeflow.commands.bench.common import add_cluster_layout, run_cluster_grid

EXPERTS_PER_RANK = (1, 4, 16)
"""The E / W the issue's report asks for (k = 2)."""


def add(benches: Any) -> None:
    dedup = benches.add_parser(
        "dedup", help="a token once to each rank (token_exchange='dedup') against the ragged exchange (needs root)",
        description="One dropless expert-parallel layer per point, E / W experts per rank, the same weights and "
        "tokens under token_exchange ragged and dedup: the rows the forward's dispatch sends and their ratio "
        "beside the share the planner and simulator price, the all-to-all bytes of a training step, and the "
        "step's time (pipeline degree 1, round-robin, the slowest rank's medians).",
    )
    add_cluster_layout(dedup, ranks_per_node=1)
    dedup.add_argument("--experts-per-rank", type=positive_int, nargs="+", default=list(EXPERTS_PER_RANK),
                       help="E / W of each point (default 1 4 16)")
    dedup.add_argument("--hidden-dim", type=positive_int, default=1024, help="expert hidden size H (default 1024)")
    dedup.add_argument("--model-dim", type=positive_int, default=512, help="model dimension M (default 512)")
    dedup.add_argument("--tokens", type=positive_int, default=2048, help="tokens per rank (default 2048)")
    dedup.add_argument("--top-k", type=positive_int, default=2, help="experts per token k (default 2)")
    dedup.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per exchange (default 5)")
    dedup.add_argument("--alltoall", choices=("linear", "2dh"), default="linear",
                       help="the all-to-all (default linear; 2dh: the dedup exchange sends a token once to each node)")
    add_progress_flag(dedup)
    dedup.set_defaults(func=run_dedup)


def run_dedup(args: argparse.Namespace) -> int:
    from moeflow.bench.dedup import DedupPoint, run, summarize

    ranks = args.nodes * args.ranks_per_node
    grid = [DedupPoint(per_rank * ranks, args.hidden_dim, args.tokens, args.model_dim, args.top_k, args.alltoall)
            for per_rank in args.experts_per_rank]
    if any(args.top_k > point.num_experts for point in grid):
        raise fail("bench dedup", f"--top-k {args.top_k} exceeds the experts of a point ({ranks} ranks x "
                   f"--experts-per-rank {min(args.experts_per_rank)}): lower --top-k or raise --experts-per-rank")
    return run_cluster_grid("bench dedup", run, summarize, grid, args)
