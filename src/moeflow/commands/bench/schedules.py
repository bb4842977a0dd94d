"""``moeflow bench schedules``: replicated experts against expert parallelism.

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
    schedules = benches.add_parser(
        "schedules", help="replicated experts vs expert parallelism as whole training steps on an emulated cluster, "
        "and what parallel='auto' picks (needs root)",
        description="Grid: --num-experts x --hidden-dims at --batch x --context tokens per rank (a one-block MoE "
        "transformer). Without --profile the ranks calibrate the cluster first.",
    )
    add_cluster_layout(schedules, ranks_per_node=1)
    schedules.add_argument("--num-experts", type=positive_int, nargs="+", default=[2, 4, 8],
                           help="numbers of experts E to try (default 2 4 8)")
    add_renamed_flag(schedules, "--experts", "--num-experts", type=positive_int, nargs="+")
    schedules.add_argument("--hidden-dims", type=positive_int, nargs="+", default=[64, 256, 1024],
                           help="expert hidden sizes H to try (default 64 256 1024)")
    schedules.add_argument("--model-dim", type=positive_int, default=256, help="model dimension M (default 256)")
    schedules.add_argument("--batch", type=positive_int, default=8, help="sequences per rank and step (default 8)")
    schedules.add_argument("--context", type=positive_int, default=128, help="tokens per sequence (default 128)")
    schedules.add_argument("--repeats", type=positive_int, default=5, help="timed steps per schedule (default 5)")
    add_progress_flag(schedules)
    schedules.set_defaults(func=run_schedules)


def run_schedules(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench.schedules import SchedulePoint, run, summarize

    grid = [SchedulePoint(e, h, args.model_dim, args.batch, args.context)
            for e, h in itertools.product(args.num_experts, args.hidden_dims)]
    return run_cluster_grid("bench schedules", run, summarize, grid, args)
