"""``moeflow bench simulator``: the simulator against the emulated cluster.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, require_testbed, show_progress


def add(benches: Any) -> None:
    from moeflow.bench.sim_validation import BENCHES as SIMULATOR_BENCHES  # no torch: the parser stays light

    sim = benches.add_parser(
        "simulator", help="the simulator's MoE layer times against measurement on emulated clusters (needs root)",
        description="Per layout and bandwidth: calibrate, measure every fixed (degree, all-to-all) of bench "
        "pipeline, simulate the same on the calibrated profile's twin; errors and the simulator's plan regret.",
    )
    sim.add_argument("--layouts", default="2x1,2x2",
                     help="the emulated clusters, nodes x ranks per node, comma list (default 2x1,2x2)")
    sim.add_argument("--bandwidths", default="0.5,1,2",
                     help="inter-node bandwidths in Gbit/s, comma list (default 0.5,1,2)")
    sim.add_argument("--repeats", type=positive_int, default=3, help="timed rounds, medians (default 3)")
    sim.add_argument("--profiles", default=None,
                     help="folder that keeps the calibrated profiles and measured.jsonl (default: temporary)")
    sim.add_argument("--plot", default=None, metavar="PNG",
                     help="write the scatter plot of simulated vs measured to this PNG")
    sim.add_argument("--benches", default=",".join(SIMULATOR_BENCHES),
                     help=f"the benchmarks to measure, comma list (default {','.join(SIMULATOR_BENCHES)})")
    sim.add_argument("--replay", default=None, metavar="FOLDER",
                     help="score a recorded run again (its measured.jsonl and profiles) instead of measuring")
    add_progress_flag(sim)
    sim.set_defaults(func=run_simulator)


def run_simulator(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from moeflow.bench.sim_validation import BENCHES, GRID, run, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar
    from moeflow.testbed import ClusterError

    if args.replay:
        from moeflow.bench.sim_validation import MEASURED, replay

        if not (Path(args.replay) / MEASURED).is_file():
            raise fail("bench simulator", f"--replay {args.replay} has no {MEASURED}; pass the --profiles folder "
                       "of a recorded run")
        records = replay(Path(args.replay))
        for record in records:
            print_json(record)
        _simulator_plot(records, args.plot)
        print_json(summarize(records))
        return 0
    require_testbed("bench simulator")
    try:
        layouts = tuple(tuple(int(n) for n in word.split("x")) for word in args.layouts.split(","))
        bandwidths = tuple(float(word) for word in args.bandwidths.split(","))
    except ValueError:
        raise fail("bench simulator", "--layouts takes NxG,NxG (e.g. 2x1,2x2) and --bandwidths numbers") from None
    benches = tuple(args.benches.split(","))
    if set(benches) - set(BENCHES):
        raise fail("bench simulator", f"--benches takes a comma list of {', '.join(BENCHES)}")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.profiles or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            with progress_bar("bench simulator", "point", enabled=show_progress(args)) as progress:
                records = run(layouts, bandwidths, list(GRID), args.repeats, folder, print_json, benches, progress)
        except (ClusterError, RuntimeError) as error:
            raise fail("bench simulator", error) from None
    _simulator_plot(records, args.plot)
    print_json(summarize(records))
    return 0


def _simulator_plot(records: list[dict[str, Any]], plot: str | None) -> None:
    from pathlib import Path

    from moeflow.bench.sim_validation import scatter
    from moeflow.files import print_json

    if plot and records:
        print_json({"plot": str(scatter(records, Path(plot)))})
