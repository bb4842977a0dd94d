"""``moeflow bench wire``: the wire formats against the exact exchange on an emulated cluster.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench.wire`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int
from moeflow.commands.bench.common import add_cluster_layout, add_routed_layer, run_cluster_grid


def add(benches: Any) -> None:
    wire = benches.add_parser(
        "wire", help="the bf16 and fp8 wire formats against the exact exchange: time and error (needs root)",
        description="One expert-parallel layer per point, the same weights and tokens with wire_dtype exact, bf16 "
        "and fp8: one exchange of its dispatch buffer, its training step at pipeline degree 1 (round-robin, the "
        "slowest rank's medians), and each format's error against the exact layer (output, input and expert "
        "gradients). Then moeflow train of a small model on local workers in each format, the loss at the last "
        "step against the exact run's (--loss-only: this part alone, without root).",
    )
    add_cluster_layout(wire, ranks_per_node=1)
    add_routed_layer(wire, num_experts=8, model_dim=512, top_k=2)
    wire.add_argument("--capacity-factor", type=float, default=1.0, help="capacity factor f (default 1)")
    wire.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per format (default 5)")
    wire.add_argument("--train-steps", type=int, default=200,
                      help="steps of each format's moeflow train run (default 200; 0: no runs)")
    wire.add_argument("--train-workers", type=positive_int, default=2, help="workers of those runs (default 2)")
    wire.add_argument("--loss-only", action="store_true", help="only the training runs (no emulated cluster)")
    add_progress_flag(wire)
    wire.set_defaults(func=run_wire)


def run_wire(args: argparse.Namespace) -> int:
    from moeflow.bench.wire import WirePoint, run, summarize

    ranks = args.nodes * args.ranks_per_node
    if args.top_k > args.num_experts or args.num_experts % ranks:
        raise fail("bench wire", f"need --top-k <= --num-experts and --num-experts divisible by the {ranks} ranks")
    if args.capacity_factor <= 0:
        raise fail("bench wire", f"--capacity-factor {args.capacity_factor}: give a factor > 0 (the buffer's size)")
    if args.train_steps < 0 or (args.loss_only and not args.train_steps):
        raise fail("bench wire", f"--train-steps {args.train_steps}: give a number of steps > 0 (0 skips the runs, "
                   "not with --loss-only)")
    point = WirePoint(args.num_experts, args.hidden_dim, args.tokens, args.model_dim, args.top_k, args.capacity_factor)
    if not args.loss_only:
        run_cluster_grid("bench wire", run, summarize, [point], args)
    if args.train_steps:
        _loss_runs(args)
    return 0


def _loss_runs(args: argparse.Namespace) -> None:
    import tempfile

    from moeflow.bench.wire import loss_curves, summarize_losses
    from moeflow.files import print_json

    with tempfile.TemporaryDirectory() as folder:
        try:
            records = loss_curves(args.train_steps, args.train_workers, folder)
        except RuntimeError as error:
            raise fail("bench wire", error) from None
    print_json(summarize_losses(records))
