"""``moeflow bench faults``: the fault drill.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, show_progress


def add(benches: Any) -> None:
    faults = benches.add_parser(
        "faults", help="the fault drill: kill, stop or delay each of 2 workers at each phase of training and "
        "generation; time to exit, the message, what was kept",
        description="A small 2-worker run per fault: the fault fires as the worker enters its first collective of "
        "the phase (forward, backward, gradient sync under each --grad-sync, checkpoint save, evaluation; and a "
        "2-worker generation). Each record gives the seconds from the fault to the job's end, whether the message "
        "named the worker and the phase, the workers left behind, the last checkpoint and (--resume) the step the "
        "resumed run reached. The summary counts the faults handled within the collective timeout + 10 s.",
    )
    faults.add_argument("--collective-timeout-s", type=float, default=5.0,
                        help="the runs' collective timeout, seconds (default 5)")
    faults.add_argument("--kinds", nargs="+", default=["kill", "stop", "delay"], choices=["kill", "stop", "delay"],
                        help="the faults to inject (default all)")
    faults.add_argument("--resume", action="store_true", help="resume each failed run from its last checkpoint")
    add_progress_flag(faults)
    faults.set_defaults(func=run_faults)


def run_faults(args: argparse.Namespace) -> int:
    from moeflow.bench.faults import DELAY_S, run
    from moeflow.progress import progress_bar

    if args.collective_timeout_s <= DELAY_S:
        raise fail("bench faults", f"--collective-timeout-s {args.collective_timeout_s} must exceed the drill's "
                   f"{DELAY_S:g} s delay (a delay shorter than the timeout must not fail the job)")
    with progress_bar("bench faults", "fault", enabled=show_progress(args)) as progress:
        return run(args.collective_timeout_s, args.resume, tuple(args.kinds), progress)
