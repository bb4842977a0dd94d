"""``moeflow bench plan``: the joint planner's pick against its runners-up as ``moeflow train --plan``
runs on an emulated cluster.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench.plan_runs`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, require_testbed, show_progress
from moeflow.commands.bench.common import add_cluster_layout


def add(benches: Any) -> None:
    plan = benches.add_parser(
        "plan", help="the joint planner's plan against its runners-up as moeflow train --plan runs on an emulated "
        "cluster: predicted vs measured step time and the pick's regret (needs root)",
        description="Calibrates the cluster (unless --profile), writes the planner's top plans for the benchmark's "
        "model (or --config's) as plan files, and runs each as moeflow train --plan, round-robin, --repeats times.",
    )
    add_cluster_layout(plan, ranks_per_node=2)
    plan.add_argument("--config", default=None, help="a moeflow train config file: its model and run instead of the "
                      "benchmark's (2 layers, M 256, H 1024, 8 experts, 8 x 128 tokens, 12 steps)")
    plan.add_argument("--top", type=positive_int, default=5, help="plans to run, the planner's fastest (default 5)")
    plan.add_argument("--repeats", type=positive_int, default=3, help="runs of each plan, medians (default 3)")
    plan.add_argument("--steps", type=positive_int, default=None, help="training steps per run (default 12)")
    plan.add_argument("--out", default=None, help="keep the profile, plan files and runs in this folder "
                      "(default: a temporary one)")
    add_progress_flag(plan)
    plan.set_defaults(func=run_plan_bench)


def run_plan_bench(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from moeflow.bench.plan_runs import BENCH_MODEL, run, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar
    from moeflow.testbed import ClusterError, ClusterSpec
    from moeflow.training.config import load_config_file

    try:
        settings = {**BENCH_MODEL, **(load_config_file(args.config) if args.config else {})}
        settings |= {"steps": args.steps} if args.steps else {}
        spec = ClusterSpec(args.nodes, args.ranks_per_node, args.inter_gbit)
    except (ValueError, FileNotFoundError) as error:
        raise fail("bench plan", error) from None
    require_testbed("bench plan")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.out or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        profile = Path(args.profile) if args.profile else None
        try:
            with progress_bar("bench plan", "run", enabled=show_progress(args)) as progress:
                records = run(spec, folder, settings, args.top, args.repeats, profile, progress=progress)
        except (ClusterError, RuntimeError, ValueError) as error:
            raise fail("bench plan", error) from None
    print_json(summarize(records))
    return 0
