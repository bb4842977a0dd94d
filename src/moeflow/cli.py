"""The ``moeflow`` command line: one module per subcommand in :mod:`moeflow.commands`, each
registering its parser with ``set_defaults(func=...)``; subcommands import what they need lazily,
so ``--help`` is fast."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moeflow.commands import bench, calibrate, cluster, generate, plan, profile_routing, simulate, train

COMMANDS = (train, generate, profile_routing, bench, calibrate, plan, simulate, cluster)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeflow", description="Fast distributed Mixture-of-Experts training and inference."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import os

    from moeflow.runtime import tune_cpu_allocator, tuning_requested

    args = build_parser().parse_args(argv)
    tune_cpu_allocator(tuning_requested(os.environ))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
