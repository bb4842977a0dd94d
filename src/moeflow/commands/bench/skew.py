"""``moeflow bench skew``: skewed load: shadowing, the smart schedule, redundant slots.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, add_renamed_flag, fail, positive_int
from moeflow.commands.bench.common import (
    add_cluster_layout,
    add_routed_layer,
    run_cluster_grid,
)
from moeflow.config import TOKEN_EXCHANGE_CHOICES


def add(benches: Any) -> None:
    skew = benches.add_parser(
        "skew", help="FasterMoE's shadowing off / hottest expert / auto under skewed routing on an emulated "
        "cluster (needs root)",
        description="Routing is pinned to a distribution: uniform, Zipf(s), one expert taking every token, or the "
        "load a training run recorded (--trace, one point per MoE block). One dropless expert-parallel layer. "
        "Without --profile the ranks calibrate the cluster first.",
    )
    add_cluster_layout(skew, ranks_per_node=1)
    skew.add_argument("--skews", nargs="+", default=["uniform", "zipf:1.2", "one-hot"],
                      help="routing distributions to pin: uniform, zipf:<s>, one-hot (default: uniform zipf:1.2 "
                      "one-hot)")
    skew.add_argument("--trace", default=None,
                      help="a training run's directory or metrics.jsonl: replay each block's recorded load")
    skew.add_argument("--trace-steps", type=positive_int, default=10,
                      help="average the load over this many last recorded steps (default 10)")
    add_routed_layer(skew, num_experts=4, model_dim=256, top_k=1, experts_note="; a trace sets its own")
    add_renamed_flag(skew, "--experts", "--num-experts", type=positive_int)
    skew.add_argument("--redundant-experts", type=positive_int, default=None,
                      help="extra expert slots of the redundant mode (default: one per rank)")
    skew.add_argument("--token-exchange", choices=TOKEN_EXCHANGE_CHOICES, default="padded",
                      help="every mode's token exchange: padded, ragged (only kept tokens travel) or auto "
                      "(default padded; the smart modes always send padded)")
    skew.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per mode (default 5)")
    add_progress_flag(skew)
    skew.set_defaults(func=run_skew)


def run_skew(args: argparse.Namespace) -> int:
    from moeflow.bench.skew import SkewPoint, recorded_loads, routing_probabilities, run, summarize

    ranks = args.nodes * args.ranks_per_node
    redundant = args.redundant_experts or ranks
    grid = [SkewPoint(name, args.num_experts, args.hidden_dim, args.tokens, args.model_dim, args.top_k,
                      redundant_experts=redundant, token_exchange=args.token_exchange) for name in args.skews]
    if args.trace:
        try:
            loads = recorded_loads(args.trace, args.trace_steps)
        except (OSError, ValueError) as error:
            raise fail("bench skew", f"--trace {args.trace}: {error}") from None
        grid += [SkewPoint(name, len(shares), args.hidden_dim, args.tokens, args.model_dim, args.top_k, shares,
                           redundant, args.token_exchange) for name, shares in loads.items()]
    try:
        for point in grid:
            routing_probabilities(point)
    except ValueError as error:
        raise fail("bench skew", f"--skews: {error}") from None
    for point in grid:
        e = point.num_experts
        if point.top_k > e or e % ranks or (e + redundant) % ranks:
            raise fail("bench skew", f"{point.name}: need --top-k <= --num-experts, and --num-experts and "
                       f"--num-experts + --redundant-experts ({redundant}) divisible by the {ranks} ranks")
    return run_cluster_grid("bench skew", run, summarize, grid, args)
