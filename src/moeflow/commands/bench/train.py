"""``moeflow bench train``: training steps per second and MFU.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, show_progress


def add(benches: Any) -> None:
    train = benches.add_parser(
        "train", help="model FLOPs utilization and the MoE layers' non-GEMM share of the default training run",
        description="Trains the default model (or --config) for --steps steps on --workers workers, then measures "
        "the matmul throughput of the same workers; medians over the steps after --warmup.",
    )
    train.add_argument("--steps", type=positive_int, default=40, help="training steps (default 40)")
    train.add_argument("--warmup", type=int, default=15,
                       help="first steps left out of the medians (planner trials, warm-up; default 15)")
    train.add_argument("--workers", type=positive_int, default=None,
                       help="worker processes that train (default: the config's, 2)")
    train.add_argument("--config", default=None, help="a TOML, YAML or JSON file of training settings")
    add_progress_flag(train)
    train.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from moeflow.bench.train import run
    from moeflow.training.config import TrainConfig, load_config_file

    try:
        values = load_config_file(args.config) if args.config else {}
        values["steps"] = args.steps
        if args.workers is not None:
            values["workers"] = args.workers
        config = TrainConfig(**{**values, "stop_at": None})
    except (ValueError, FileNotFoundError) as error:
        raise fail("bench train", error) from None
    return run(config, args.warmup, progress=show_progress(args) and config.progress)
