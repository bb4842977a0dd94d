"""``moeflow bench monitor``: what the MoE monitor costs a step of the default run's model.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench.monitor`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import positive_int


def add(benches: Any) -> None:
    monitor = benches.add_parser(
        "monitor", help="the MoE monitor's cost: a step of the default model with and without it",
        description="The default run's model (moeflow train's defaults), one process, one intra-op thread: its "
        "forward and backward with the monitor's hooks and its step against the same step without them, "
        "interleaved; medians and the overhead.",
    )
    monitor.add_argument("--repeats", type=positive_int, default=15, help="pairs of timed steps (default 15)")
    monitor.set_defaults(func=run_monitor)


def run_monitor(args: argparse.Namespace) -> int:
    from moeflow.bench.monitor import run

    run(args.repeats)
    return 0
