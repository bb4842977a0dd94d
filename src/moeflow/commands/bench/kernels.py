"""``moeflow bench kernels``: each expert kernel and encode/decode backend alone.

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
    kernels = benches.add_parser(
        "kernels", help="encode/decode (GB/s) and the grouped expert GEMM (TFLOP/s) against the measured peak",
        description="Encode and decode forward and the ragged grouped GEMM of the experts, each kernel backend "
        "(torch; Triton on CUDA; torch._grouped_mm where it runs), beside a matmul and a copy of the same run that "
        "give the device's compute rate and memory bandwidth.",
    )
    kernels.add_argument("--tokens", type=positive_int, default=16384, help="tokens routed (default 16384)")
    kernels.add_argument("--model-dim", type=positive_int, default=1024, help="model dimension M (default 1024)")
    kernels.add_argument("--hidden-dim", type=positive_int, default=1408, help="expert hidden size H (default 1408)")
    kernels.add_argument("--num-experts", type=positive_int, default=64, help="number of experts E (default 64)")
    add_renamed_flag(kernels, "--experts", "--num-experts", type=positive_int)
    kernels.add_argument("--top-k", type=positive_int, default=8, help="experts each token is routed to (default 8)")
    kernels.add_argument("--device", default="cpu", help="device to run on: cpu or cuda[:N] (default cpu)")
    kernels.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                         help="dtype of the tokens, the weights and the peak matmul (default bf16 on CUDA, fp32 on "
                         "CPU)")
    kernels.add_argument("--matmul-size", type=positive_int, default=None,
                         help="side of the square peak matmul (default 8192 on CUDA, 2048 on CPU)")
    kernels.add_argument("--repeats", type=positive_int, default=5, help="timed rounds, medians (default 5)")
    add_progress_flag(kernels)
    kernels.set_defaults(func=run_kernels)


def run_kernels(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench.kernels import KernelBenchConfig, measure_kernels, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar

    device = device_for(args.device, "bench kernels")
    if args.top_k > args.num_experts:
        raise fail("bench kernels", f"--top-k {args.top_k} exceeds --num-experts {args.num_experts}")
    on_gpu = device.type == "cuda"
    config = KernelBenchConfig(
        tokens=args.tokens, model_dim=args.model_dim, hidden_dim=args.hidden_dim, num_experts=args.num_experts,
        top_k=args.top_k, device=str(device), dtype=args.dtype or ("bf16" if on_gpu else "fp32"),
        matmul_size=args.matmul_size or (8192 if on_gpu else 2048), copy_mb=1024 if on_gpu else 256,
        repeats=args.repeats,
    )
    if not on_gpu:
        torch.set_num_threads(1)
    with progress_bar("bench kernels", "sample", enabled=show_progress(args)) as progress:
        records = measure_kernels(config, progress)
    for record in records:
        print_json(record)
    print_json(summarize(records))
    return 0
