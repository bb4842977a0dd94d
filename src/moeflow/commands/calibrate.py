"""``moeflow calibrate``: fit the alpha-beta cost models (GEMM, collectives, interference) of this
machine or cluster and write a profile."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import positive_int


def add_parser(commands: Any) -> None:
    calibrate = commands.add_parser(
        "calibrate", help="fit alpha-beta cost models (GEMM, collectives, interference); write a profile",
        description="Locally it spawns --workers gloo workers; under moeflow launch or torchrun it uses the "
        "launched ranks (rank 0 writes the profile).",
    )
    calibrate.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    calibrate.add_argument("--workers", type=positive_int, default=2,
                           help="gloo workers to spawn when not launched (default 2)")
    calibrate.add_argument("--model-dim", type=positive_int, default=512,
                           help="model dimension of the GEMMs timed (default 512)")
    calibrate.add_argument("--hidden-dim", type=positive_int, default=1024,
                           help="hidden dimension of the GEMMs timed (default 1024)")
    calibrate.add_argument("--repeats", type=positive_int, default=5, help="timings per point, medians (default 5)")
    calibrate.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace

    from moeflow.bench import print_json
    from moeflow.calibrate import CalibrationConfig, calibrate_from_env, calibrate_rank
    from moeflow.distributed import run_distributed
    from moeflow.perf import ClusterProfile

    config = CalibrationConfig(
        model_dim=args.model_dim, hidden_dim=args.hidden_dim, repeats=args.repeats,
        latency_emulated=os.environ.get("MOEFLOW_TESTBED_LATENCY_EMULATED"),
    )
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # ranks of moeflow launch / torchrun
        per_node = os.environ.get("LOCAL_WORLD_SIZE")
        profile = calibrate_from_env(replace(config, ranks_per_node=int(per_node) if per_node else None))
        if profile is None:
            return 0
    else:
        profile = run_distributed(calibrate_rank, args.workers, config, timeout_s=1800)[0]
    for report in profile["quality"]["fits"]:
        print_json(report)
    ClusterProfile.from_dict(profile).save(args.out)
    fits = profile["quality"]["fits"]
    print_json({"summary": "calibrate", "profile": args.out, "fits": len(fits),
                "min_r2": min(f["r2"] for f in fits),
                "max_heldout_median_rel_error": max(f["heldout_median_rel_error"] for f in fits),
                "interference": profile["interference"]})
    return 0
