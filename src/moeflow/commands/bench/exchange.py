"""``moeflow bench exchange``: the padded against the ragged token exchange.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int
from moeflow.commands.bench.common import (
    add_cluster_layout,
    add_routed_layer,
    pipeline_choice,
    run_cluster_grid,
)


def add(benches: Any) -> None:
    exchange = benches.add_parser(
        "exchange", help="the ragged token exchange against the padded one (and the planner's pick) under set "
        "routing on an emulated cluster (needs root)",
        description="One expert-parallel layer with the padded exchange and kernel, the padded exchange with the "
        "ragged kernel, the ragged exchange and kernel, and token_exchange auto: training steps and "
        "inference forwards, round-robin, the slowest rank's medians, and each mode's all-to-all bytes. Each point "
        "is a routing distribution at a capacity factor, given as <skew>@<factor> (e.g. zipf:1.2@0 for dropless). "
        "Without --profile the ranks calibrate the cluster first.",
    )
    add_cluster_layout(exchange, ranks_per_node=1)
    exchange.add_argument("--points", nargs="+", default=["uniform@1", "uniform@0", "zipf:1.2@0", "zipf:1.2@1"],
                          help="<skew>@<capacity factor> points (default: uniform@1 uniform@0 zipf:1.2@0 zipf:1.2@1)")
    add_routed_layer(exchange, num_experts=8, model_dim=512, top_k=2)
    exchange.add_argument("--pipeline", type=pipeline_choice, default="auto",
                          help="every mode's pipeline: a policy, or one degree for all, run with the linear "
                          "all-to-all, so that only the exchange differs (default auto)")
    exchange.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per mode (default 5)")
    add_progress_flag(exchange)
    exchange.set_defaults(func=run_exchange)


def run_exchange(args: argparse.Namespace) -> int:
    from moeflow.bench.exchange import ExchangePoint, run, summarize
    from moeflow.bench.skew import SkewPoint, routing_probabilities

    grid = []
    for text in args.points:
        skew, _, factor = text.partition("@")
        try:
            routing_probabilities(SkewPoint(skew, args.num_experts))
            capacity_factor = float(factor or 0.0)
        except ValueError as error:
            raise fail("bench exchange", f"--points {text!r}: {error}; write <skew>@<capacity factor>") from None
        grid.append(ExchangePoint(skew, capacity_factor, args.num_experts, args.hidden_dim, args.tokens,
                                  args.model_dim, args.top_k, args.pipeline))
    ranks = args.nodes * args.ranks_per_node
    if args.top_k > args.num_experts or args.num_experts % ranks:
        raise fail("bench exchange", f"need --top-k <= --num-experts and --num-experts divisible by the {ranks} ranks")
    return run_cluster_grid("bench exchange", run, summarize, grid, args)
