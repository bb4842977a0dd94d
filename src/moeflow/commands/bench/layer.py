"""``moeflow bench layer``: MoELayer against the plain reference and the FLOP floor.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, add_renamed_flag, fail, positive_int, show_progress
from moeflow.commands.bench.common import (
    device_for,
)
from moeflow.config import DTYPE_NAMES, EXPERT_KERNELS, STEP_SHAPES


def add(benches: Any) -> None:
    layer = benches.add_parser(
        "layer", help="MoELayer vs the plain reference and the FLOP floor, forward+backward",
        description="Without --num-experts/--hidden-dim it measures the two target shapes (E=8, H=2048) and "
        "(E=64, H=256).",
    )
    layer.add_argument("--tokens", type=int, default=4096, help="tokens per worker (default 4096)")
    layer.add_argument("--model-dim", type=positive_int, default=512, help="model dimension M (default 512)")
    layer.add_argument("--hidden-dim", type=positive_int, default=None,
                       help="expert hidden size H (default: the two target shapes; with --num-experts alone, 2048)")
    layer.add_argument("--num-experts", type=positive_int, default=None,
                       help="number of experts E (default: the two target shapes; with --hidden-dim alone, 8)")
    add_renamed_flag(layer, "--experts", "--num-experts", type=positive_int)
    layer.add_argument("--top-k", type=positive_int, default=2, help="experts each token is routed to (default 2)")
    layer.add_argument("--capacity-factor", type=float, default=1.0, help="Tutel's capacity factor (default 1)")
    layer.add_argument("--activation", default="gelu", choices=("relu", "gelu", "silu", "swiglu"),
                       help="expert activation (default gelu)")
    layer.add_argument("--workers", type=positive_int, default=1,
                       help="gloo worker processes, one intra-op thread each (default 1)")
    layer.add_argument("--repeats", type=positive_int, default=5, help="timed rounds, medians (default 5)")
    layer.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    layer.add_argument("--no-kernels", action="store_true", help="skip timing each expert kernel alone")
    layer.add_argument("--no-bias", action="store_true",
                       help="experts without biases, as Mixtral's and Qwen-MoE's (default: with biases)")
    layer.add_argument("--expert-kernel", default="bmm", choices=EXPERT_KERNELS,
                       help="the layer's expert kernel: bmm (padded), loop, or ragged (dropless; on one process "
                            "the kept-rows path with no capacity buffer) (default bmm)")
    layer.add_argument("--step-shapes", default="auto", choices=STEP_SHAPES,
                       help="the layer's step: static sizes it from the call alone (one process, no host read of "
                            "the routing counts), dynamic from those counts, auto static on a GPU (default auto)")
    layer.add_argument("--cuda-graph", action="store_true",
                       help="time the layer's static step captured in CUDA graphs (needs --device cuda)")
    layer.add_argument("--device", default="cpu", help="device to run on: cpu or cuda[:N] (one process; default cpu)")
    layer.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES,
                       help="parameters, tokens and the floor's matmul in this dtype (default fp32)")
    layer.add_argument("--matmul-size", type=positive_int, default=2048,
                       help="side of the square matmul that gives the FLOP floor's rate (default 2048)")
    add_progress_flag(layer)
    layer.set_defaults(func=run_layer)


def _layer_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    from moeflow.bench.layer import DEFAULT_SHAPES

    if (args.num_experts is None) != (args.hidden_dim is None):
        shapes = [(args.num_experts or 8, args.hidden_dim or 2048)]
    else:
        shapes = list(DEFAULT_SHAPES) if args.num_experts is None else [(args.num_experts, args.hidden_dim)]
    for num_experts, _ in shapes:
        if args.top_k > num_experts:
            raise fail("bench layer", f"--top-k {args.top_k} exceeds --num-experts {num_experts}")
        if num_experts % args.workers:
            raise fail("bench layer", f"--num-experts {num_experts} is not divisible by --workers {args.workers}")
    return shapes


def run_layer(args: argparse.Namespace) -> int:
    from moeflow.bench.layer import summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar

    if args.tokens < 0:
        raise fail("bench layer", f"--tokens must be >= 0, got {args.tokens}")
    device = device_for(args.device, "bench layer")
    if device.type != "cpu" and args.workers > 1:
        raise fail("bench layer", f"--device {args.device} runs one process: leave --workers at 1")
    if args.cuda_graph and (device.type != "cuda" or args.step_shapes == "dynamic" or args.capacity_factor <= 0):
        raise fail("bench layer", "--cuda-graph captures the static step: use --device cuda, --capacity-factor > 0 "
                   "and --step-shapes static or auto")
    if args.step_shapes == "static" and (args.workers > 1 or args.capacity_factor <= 0):
        raise fail("bench layer", "--step-shapes static runs one process with --capacity-factor > 0")
    results, shapes = [], _layer_shapes(args)
    with progress_bar("bench layer", "shape", len(shapes), enabled=show_progress(args)) as progress:
        for num_experts, hidden_dim in shapes:
            results.append(_measure_shape(args, device, num_experts, hidden_dim))
            progress.advance()
    print_json(summarize(results))
    return 0


def _measure_shape(args: argparse.Namespace, device: Any, num_experts: int, hidden_dim: int) -> dict[str, Any]:
    """One shape's measurement, printed as it ends."""
    import torch

    from moeflow.bench.layer import LayerBenchConfig, measure_layer, slowest_worker
    from moeflow.config import LayerDims, ffn_projections
    from moeflow.distributed import run_distributed
    from moeflow.files import print_json

    dims = LayerDims(args.model_dim, hidden_dim, num_experts, args.top_k, ffn_projections(args.activation),
                     bias=not args.no_bias)
    config = LayerBenchConfig(
        dims=dims, tokens=args.tokens, capacity_factor=args.capacity_factor, activation=args.activation,
        repeats=args.repeats, warmup=args.warmup, measure_kernels=not args.no_kernels,
        device=str(device), dtype=args.dtype, matmul_size=args.matmul_size, expert_kernel=args.expert_kernel,
        step_shapes=args.step_shapes, cuda_graph=args.cuda_graph,
    )
    if args.workers == 1:
        torch.set_num_threads(1)
        result = measure_layer(0, 1, config)
    else:
        result = slowest_worker(run_distributed(measure_layer, args.workers, config))
    print_json(result)
    return result
