"""``moeflow bench overlap``: how much of a chunk's all-to-all its experts hide.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, add_renamed_flag, fail, positive_int, show_progress
from moeflow.commands.bench.common import (
    device_for,
)
from moeflow.config import DTYPE_NAMES


def add(benches: Any) -> None:
    overlap = benches.add_parser(
        "overlap", help="the pipeline's overlap of a simulated transfer with the expert chunks, on one device",
        description="The pipelined experts' forward at each degree over a route that copies every chunk out and "
        "back (on CUDA: a device-host round trip through pinned memory on the communication stream; on a CPU: a "
        "copy on the communication thread), beside the experts alone and the copies alone: ratio_to_ideal is the "
        "pipelined time over max(t_comp, t_copy).",
    )
    overlap.add_argument("--num-experts", type=positive_int, default=8, help="local experts (default 8)")
    add_renamed_flag(overlap, "--experts", "--num-experts", type=positive_int)
    overlap.add_argument("--capacity", type=positive_int, default=1024, help="slots per expert (default 1024)")
    overlap.add_argument("--model-dim", type=positive_int, default=1024, help="model dimension M (default 1024)")
    overlap.add_argument("--hidden-dim", type=positive_int, default=2048, help="expert hidden size H (default 2048)")
    overlap.add_argument("--degrees", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                         help="pipeline degrees to time (default 1 2 4 8)")
    overlap.add_argument("--device", default="cpu", help="device to run on: cpu or cuda[:N] (default cpu)")
    overlap.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES,
                         help="dtype of the expert weights and the chunks (default fp32)")
    overlap.add_argument("--repeats", type=positive_int, default=5, help="timed rounds, medians (default 5)")
    add_progress_flag(overlap)
    overlap.set_defaults(func=run_overlap)


def run_overlap(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench.overlap import OverlapBenchConfig, measure_overlap, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar

    device = device_for(args.device, "bench overlap")
    degrees = tuple(args.degrees)
    if max(degrees) > args.capacity:
        raise fail("bench overlap", f"--degrees must lie in 1..--capacity ({args.capacity}), got {args.degrees}")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the experts on one core, the copies on the communication thread
    config = OverlapBenchConfig(
        num_experts=args.num_experts, capacity=args.capacity, model_dim=args.model_dim, hidden_dim=args.hidden_dim,
        degrees=degrees, device=str(device), dtype=args.dtype, repeats=args.repeats,
    )
    with progress_bar("bench overlap", "sample", enabled=show_progress(args)) as progress:
        records = measure_overlap(config, progress)
    for record in records:
        print_json(record)
    print_json(summarize(records))
    return 0
