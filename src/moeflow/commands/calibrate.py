"""``moeflow calibrate``: fit the alpha-beta cost models (GEMM, encode/decode, expert FFN, collectives,
interference) of this machine or cluster and write a profile."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, show_progress
from moeflow.config import DTYPE_NAMES


def add_parser(commands: Any) -> None:
    calibrate = commands.add_parser(
        "calibrate", help="fit alpha-beta cost models (GEMM, collectives, interference); write a profile",
        description="Locally it spawns --workers gloo workers (--device cpu) or runs one process on the GPU "
        "(--device cuda); under moeflow launch or torchrun it uses the launched ranks, one GPU each with "
        "--device cuda (rank 0 writes the profile).",
    )
    calibrate.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    calibrate.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                           help="where the GEMM, encode/decode, FFN and layer fits run (default cpu); cuda: on "
                           "each rank's GPU, timed with CUDA events, collectives over NCCL when there are 2+ GPUs")
    calibrate.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32",
                           help="dtype of the compute fits (default fp32)")
    calibrate.add_argument("--workers", type=positive_int, default=None,
                           help="gloo workers to spawn when not launched (default 2; --device cuda: 1, one GPU)")
    calibrate.add_argument("--model-dim", type=positive_int, default=None,
                           help="model dimension of the GEMMs timed (default 512 on cpu, 4096 on cuda)")
    calibrate.add_argument("--hidden-dim", type=positive_int, default=None,
                           help="hidden dimension of the GEMMs timed (default 1024 on cpu, 8192 on cuda)")
    calibrate.add_argument("--repeats", type=positive_int, default=5, help="timings per point, medians (default 5)")
    add_progress_flag(calibrate)
    calibrate.set_defaults(func=run)


def cuda_problem(launched: bool, workers: int | None) -> str | None:
    """Why ``--device cuda`` cannot run here (no CUDA device, no NCCL, several local workers), with
    the fix; None when it can."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        return (f"--device cuda: no CUDA device is visible to torch here ({build}); run it on a machine with a GPU "
                "and a CUDA build of torch, or calibrate this machine's CPU with --device cpu")
    if not dist.is_nccl_available():
        return "--device cuda: this torch build has no NCCL; install a CUDA build of torch with NCCL"
    if not launched and workers is not None and workers > 1:
        return (f"--device cuda runs one process per GPU: for {workers} GPUs launch it as "
                f"torchrun --nproc-per-node {workers} -m moeflow calibrate --device cuda; locally --workers is 1")
    return None


def run(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace

    from moeflow.calibrate import (
        DEVICE_DIMS,
        CalibrationConfig,
        calibrate_from_env,
        calibrate_in_process,
        calibrate_rank,
    )
    from moeflow.distributed import run_distributed
    from moeflow.files import print_json
    from moeflow.perf import ClusterProfile

    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ  # ranks of moeflow launch / torchrun
    device = "cpu"
    if args.device == "cuda":
        problem = cuda_problem(launched, args.workers)
        if problem is not None:
            raise fail("calibrate", problem)
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if launched else "cuda"
    model_dim, hidden_dim = DEVICE_DIMS[args.device]
    config = CalibrationConfig(
        model_dim=args.model_dim or model_dim, hidden_dim=args.hidden_dim or hidden_dim, repeats=args.repeats,
        device=device, dtype=args.dtype,
        latency_emulated=os.environ.get("MOEFLOW_TESTBED_LATENCY_EMULATED"),
    )
    progress = show_progress(args)
    if launched:
        per_node = os.environ.get("LOCAL_WORLD_SIZE")
        profile = calibrate_from_env(replace(config, ranks_per_node=int(per_node) if per_node else None), progress)
        if profile is None:
            return 0
    elif args.device == "cuda":
        profile = calibrate_in_process(config, progress)
    else:
        profile = run_distributed(calibrate_rank, args.workers or 2, config, progress, timeout_s=1800)[0]
    for report in profile["quality"]["fits"]:
        print_json(report)
    saved = ClusterProfile.from_dict(profile)
    saved.save(args.out)
    fits = profile["quality"]["fits"]
    print_json({"summary": "calibrate", "profile": args.out, "device": saved.device.to_dict(), "fits": len(fits),
                "min_r2": min(f["r2"] for f in fits),
                "max_heldout_median_rel_error": max(f["heldout_median_rel_error"] for f in fits),
                "interference": profile["interference"]})
    return 0
