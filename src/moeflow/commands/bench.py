"""``moeflow bench layer | kernels | overlap | alltoall | pipeline | schedules | parallel | skew | exchange |
contention | train | generate | lina-inference | memory``: each prints one JSON object per measurement and a
summary line."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_renamed_flag, fail, positive_int, require_testbed
from moeflow.config import DTYPE_NAMES, EXPERT_KERNELS, TOKEN_EXCHANGE_CHOICES


def add_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark (prints JSON lines and a summary)")
    benches = bench.add_subparsers(dest="bench", required=True)
    for add in (_add_layer, _add_kernels, _add_overlap, _add_alltoall, _add_pipeline, _add_schedules, _add_parallel,
                _add_skew, _add_exchange, _add_contention, _add_train, _add_generate, _add_lina_inference,
                _add_simulator, _add_papers, _add_memory, _add_faults):
        add(benches)


def _add_cluster_layout(parser: argparse.ArgumentParser, ranks_per_node: int) -> None:
    parser.add_argument("--nodes", type=positive_int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=ranks_per_node,
                        help=f"ranks on each node (default {ranks_per_node})")
    parser.add_argument("--inter-gbit", type=float, default=1.0, help="bandwidth between nodes, Gbit/s (default 1)")
    parser.add_argument("--profile", default=None, help="a profile of this cluster (skips calibration)")


# -- layer ----------------------------------------------------------------------------------------


def _add_layer(benches: Any) -> None:
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
                            "the packed path with no capacity buffer) (default bmm)")
    layer.add_argument("--device", default="cpu", help="device to run on: cpu or cuda[:N] (one process; default cpu)")
    layer.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES,
                       help="parameters, tokens and the floor's matmul in this dtype (default fp32)")
    layer.add_argument("--matmul-size", type=positive_int, default=2048,
                       help="side of the square matmul that gives the FLOP floor's rate (default 2048)")
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
    import torch

    from moeflow.bench.layer import LayerBenchConfig, measure_layer, slowest_worker, summarize
    from moeflow.config import LayerDims, ffn_projections
    from moeflow.distributed import run_distributed
    from moeflow.files import print_json

    if args.tokens < 0:
        raise fail("bench layer", f"--tokens must be >= 0, got {args.tokens}")
    device = _device(args.device, "bench layer")
    if device.type != "cpu" and args.workers > 1:
        raise fail("bench layer", f"--device {args.device} runs one process: leave --workers at 1")
    results = []
    for num_experts, hidden_dim in _layer_shapes(args):
        dims = LayerDims(args.model_dim, hidden_dim, num_experts, args.top_k, ffn_projections(args.activation),
                         bias=not args.no_bias)
        config = LayerBenchConfig(
            dims=dims, tokens=args.tokens, capacity_factor=args.capacity_factor, activation=args.activation,
            repeats=args.repeats, warmup=args.warmup, measure_kernels=not args.no_kernels,
            device=str(device), dtype=args.dtype, matmul_size=args.matmul_size, expert_kernel=args.expert_kernel,
        )
        if args.workers == 1:
            torch.set_num_threads(1)
            result = measure_layer(0, 1, config)
        else:
            result = slowest_worker(run_distributed(measure_layer, args.workers, config))
        print_json(result)
        results.append(result)
    print_json(summarize(results))
    return 0


def _device(name: str, command: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise fail(command, f"--device {name!r} is not a device; use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise fail(command, f"--device {name} needs a CUDA GPU and this machine has none; use --device cpu")
    return device


# -- kernels --------------------------------------------------------------------------------------


def _add_kernels(benches: Any) -> None:
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
    kernels.set_defaults(func=run_kernels)


def run_kernels(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench.kernels import KernelBenchConfig, measure_kernels, summarize
    from moeflow.files import print_json

    device = _device(args.device, "bench kernels")
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
    records = measure_kernels(config)
    for record in records:
        print_json(record)
    print_json(summarize(records))
    return 0


# -- overlap --------------------------------------------------------------------------------------


def _add_overlap(benches: Any) -> None:
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
    overlap.set_defaults(func=run_overlap)


def run_overlap(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench.overlap import OverlapBenchConfig, measure_overlap, summarize
    from moeflow.files import print_json

    device = _device(args.device, "bench overlap")
    degrees = tuple(args.degrees)
    if max(degrees) > args.capacity:
        raise fail("bench overlap", f"--degrees must lie in 1..--capacity ({args.capacity}), got {args.degrees}")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the experts on one core, the copies on the communication thread
    records = measure_overlap(OverlapBenchConfig(
        num_experts=args.num_experts, capacity=args.capacity, model_dim=args.model_dim, hidden_dim=args.hidden_dim,
        degrees=degrees, device=str(device), dtype=args.dtype, repeats=args.repeats,
    ))
    for record in records:
        print_json(record)
    print_json(summarize(records))
    return 0


# -- all-to-all -----------------------------------------------------------------------------------


def _add_alltoall(benches: Any) -> None:
    alltoall = benches.add_parser(
        "alltoall", help="linear vs 2DH vs pairwise all-to-all on emulated clusters (needs root)",
    )
    alltoall.add_argument("--layouts", nargs="+", default=["2x2", "4x2", "1x4"],
                          help="the emulated clusters to measure, each NODESxRANKS_PER_NODE (default 2x2 4x2 1x4)")
    alltoall.add_argument("--sizes", type=positive_int, nargs="+", default=None,
                          help="message sizes to time, bytes per destination (default 1 KiB .. 1 MiB)")
    alltoall.add_argument("--inter-gbit", type=float, default=1.0, help="bandwidth between nodes, Gbit/s (default 1)")
    alltoall.add_argument("--inter-latency-us", type=float, default=100.0,
                          help="one-way latency between nodes in microseconds (needs sch_netem; recorded when absent; "
                          "default 100)")
    alltoall.add_argument("--repeats", type=positive_int, default=7, help="timed rounds, medians (default 7)")
    alltoall.set_defaults(func=run_alltoall)


def run_alltoall(args: argparse.Namespace) -> int:
    from moeflow.bench.alltoall import DEFAULT_SIZES, run, summarize
    from moeflow.files import print_json
    from moeflow.testbed import ClusterError

    layouts = []
    for text in args.layouts:
        nodes, _, per_node = text.partition("x")
        if not (nodes.isdigit() and per_node.isdigit() and int(nodes) >= 1 and int(per_node) >= 1):
            raise fail("bench alltoall", f"--layouts takes NODESxRANKS like 2x2, got {text!r}")
        layouts.append((int(nodes), int(per_node)))
    require_testbed("bench alltoall")
    try:
        results = run(layouts, list(args.sizes or DEFAULT_SIZES), args.inter_gbit, args.inter_latency_us,
                      args.repeats)
    except (ClusterError, RuntimeError) as error:
        raise fail("bench alltoall", error) from None
    print_json(summarize(results))
    return 0


# -- pipeline and schedules (emulated cluster grids) ----------------------------------------------


def _add_pipeline(benches: Any) -> None:
    pipeline = benches.add_parser(
        "pipeline", help="fixed pipeline degrees and all-to-alls vs the planner on an emulated cluster (needs root)",
        description="Grid: the product of the list options (default 32 configurations, from communication-bound "
        "H=256 to computation-bound H=1024 at 1 Gbit/s). Without --profile the ranks calibrate the cluster first.",
    )
    _add_cluster_layout(pipeline, ranks_per_node=2)
    pipeline.add_argument("--tokens", type=positive_int, nargs="+", default=[512, 1024],
                          help="tokens per rank to try (default 512 1024)")
    pipeline.add_argument("--model-dims", type=positive_int, nargs="+", default=[256, 512],
                          help="model dimensions M to try (default 256 512)")
    pipeline.add_argument("--hidden-dims", type=positive_int, nargs="+", default=[256, 1024],
                          help="expert hidden sizes H to try (default 256 1024)")
    pipeline.add_argument("--experts-per-rank", type=positive_int, nargs="+", default=[1, 2],
                          help="experts on each rank to try (default 1 2)")
    pipeline.add_argument("--top-k", type=positive_int, nargs="+", default=[1, 2],
                          help="experts per token k to try (default 1 2)")
    pipeline.add_argument("--repeats", type=positive_int, default=3, help="timed rounds, medians (default 3)")
    pipeline.set_defaults(func=run_pipeline)


def run_pipeline(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench.pipeline import GridPoint, run, summarize

    grid = [GridPoint(*values) for values in itertools.product(
        args.tokens, args.model_dims, args.hidden_dims, args.experts_per_rank, args.top_k)]
    return _run_cluster_grid("bench pipeline", run, summarize, grid, args)


def _add_schedules(benches: Any) -> None:
    schedules = benches.add_parser(
        "schedules", help="replicated experts vs expert parallelism as whole training steps on an emulated cluster, "
        "and what parallel='auto' picks (needs root)",
        description="Grid: --num-experts x --hidden-dims at --batch x --context tokens per rank (a one-block MoE "
        "transformer). Without --profile the ranks calibrate the cluster first.",
    )
    _add_cluster_layout(schedules, ranks_per_node=1)
    schedules.add_argument("--num-experts", type=positive_int, nargs="+", default=[2, 4, 8],
                           help="numbers of experts E to try (default 2 4 8)")
    add_renamed_flag(schedules, "--experts", "--num-experts", type=positive_int, nargs="+")
    schedules.add_argument("--hidden-dims", type=positive_int, nargs="+", default=[64, 256, 1024],
                           help="expert hidden sizes H to try (default 64 256 1024)")
    schedules.add_argument("--model-dim", type=positive_int, default=256, help="model dimension M (default 256)")
    schedules.add_argument("--batch", type=positive_int, default=8, help="sequences per rank and step (default 8)")
    schedules.add_argument("--context", type=positive_int, default=128, help="tokens per sequence (default 128)")
    schedules.add_argument("--repeats", type=positive_int, default=5, help="timed steps per schedule (default 5)")
    schedules.set_defaults(func=run_schedules)


def run_schedules(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench.schedules import SchedulePoint, run, summarize

    grid = [SchedulePoint(e, h, args.model_dim, args.batch, args.context)
            for e, h in itertools.product(args.num_experts, args.hidden_dims)]
    return _run_cluster_grid("bench schedules", run, summarize, grid, args)


def _add_parallel(benches: Any) -> None:
    parallel = benches.add_parser(
        "parallel", help="every fixed Tutel r vs the planner's per-iteration choice on an emulated cluster "
        "(needs root)",
        description="Grid: --num-experts x --hidden-dims x --capacity-factors at --tokens tokens per rank (one MoE "
        "layer). Without --profile the ranks calibrate the cluster first.",
    )
    _add_cluster_layout(parallel, ranks_per_node=1)
    parallel.add_argument("--num-experts", type=positive_int, nargs="+", default=[1, 2],
                          help="numbers of experts E to try; W > E shards each expert's hidden dimension (default 1 2)")
    add_renamed_flag(parallel, "--experts", "--num-experts", type=positive_int, nargs="+")
    parallel.add_argument("--hidden-dims", type=positive_int, nargs="+", default=[256, 2048],
                          help="expert hidden sizes H to try (default 256 2048: two expert sizes, as Tutel Fig. 12)")
    parallel.add_argument("--capacity-factors", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0],
                          help="capacity factors f to try (default 1 2 4 8)")
    parallel.add_argument("--tokens", type=positive_int, default=512, help="tokens per rank (default 512)")
    parallel.add_argument("--model-dim", type=positive_int, default=256, help="model dimension M (default 256)")
    parallel.add_argument("--mp", type=positive_int, default=1,
                          help="> 1: Parm's S1, S2, S2+SAA and auto against the DeepSpeed-MoE baseline behind MP "
                          "attention of this many ranks (N_ESP = N_MP) instead of Tutel's r")
    parallel.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per mode (default 5)")
    parallel.set_defaults(func=run_parallel)


def run_parallel(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench.parallel import ParallelPoint, run, summarize

    grid = [ParallelPoint(e, h, f, args.tokens, args.model_dim, mp=args.mp)
            for e, h, f in itertools.product(args.num_experts, args.hidden_dims, args.capacity_factors)]
    return _run_cluster_grid("bench parallel", run, summarize, grid, args)


def _add_routed_layer(
    parser: argparse.ArgumentParser, num_experts: int, model_dim: int, top_k: int, experts_note: str = ""
) -> None:
    """The shape of the one layer the routing benchmarks pin (E, H, M, tokens per rank, k)."""
    parser.add_argument("--num-experts", type=positive_int, default=num_experts,
                        help=f"number of experts E (default {num_experts}{experts_note})")
    parser.add_argument("--hidden-dim", type=positive_int, default=1024, help="expert hidden size H (default 1024)")
    parser.add_argument("--model-dim", type=positive_int, default=model_dim,
                        help=f"model dimension M (default {model_dim})")
    parser.add_argument("--tokens", type=positive_int, default=2048, help="tokens per rank (default 2048)")
    parser.add_argument("--top-k", type=positive_int, default=top_k,
                        help=f"experts each token is routed to (default {top_k})")


def _add_skew(benches: Any) -> None:
    skew = benches.add_parser(
        "skew", help="FasterMoE's shadowing off / hottest expert / auto under skewed routing on an emulated "
        "cluster (needs root)",
        description="Routing is pinned to a distribution: uniform, Zipf(s), one expert taking every token, or the "
        "load a training run recorded (--trace, one point per MoE block). One dropless expert-parallel layer. "
        "Without --profile the ranks calibrate the cluster first.",
    )
    _add_cluster_layout(skew, ranks_per_node=1)
    skew.add_argument("--skews", nargs="+", default=["uniform", "zipf:1.2", "one-hot"],
                      help="routing distributions to pin: uniform, zipf:<s>, one-hot (default: uniform zipf:1.2 "
                      "one-hot)")
    skew.add_argument("--trace", default=None,
                      help="a training run's directory or metrics.jsonl: replay each block's recorded load")
    skew.add_argument("--trace-steps", type=positive_int, default=10,
                      help="average the load over this many last recorded steps (default 10)")
    _add_routed_layer(skew, num_experts=4, model_dim=256, top_k=1, experts_note="; a trace sets its own")
    add_renamed_flag(skew, "--experts", "--num-experts", type=positive_int)
    skew.add_argument("--redundant-experts", type=positive_int, default=None,
                      help="extra expert slots of the redundant mode (default: one per rank)")
    skew.add_argument("--token-exchange", choices=TOKEN_EXCHANGE_CHOICES, default="padded",
                      help="every mode's token exchange: padded, ragged (only kept tokens travel) or auto "
                      "(default padded; the smart modes always send padded)")
    skew.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per mode (default 5)")
    skew.set_defaults(func=run_skew)


def run_skew(args: argparse.Namespace) -> int:
    from moeflow.bench.skew import SkewPoint, recorded_loads, routing_probabilities, run, summarize

    ranks = args.nodes * args.ranks_per_node
    redundant = args.redundant_experts or ranks
    grid = [SkewPoint(name, args.num_experts, args.hidden_dim, args.tokens, args.model_dim, args.top_k,
                      redundant_experts=redundant, token_exchange=args.token_exchange) for name in args.skews]
    if args.trace:
        try:
            loads = recorded_loads(args.trace, args.trace_steps)
        except (OSError, ValueError) as error:
            raise fail("bench skew", f"--trace {args.trace}: {error}") from None
        grid += [SkewPoint(name, len(shares), args.hidden_dim, args.tokens, args.model_dim, args.top_k, shares,
                           redundant, args.token_exchange) for name, shares in loads.items()]
    try:
        for point in grid:
            routing_probabilities(point)
    except ValueError as error:
        raise fail("bench skew", f"--skews: {error}") from None
    for point in grid:
        e = point.num_experts
        if point.top_k > e or e % ranks or (e + redundant) % ranks:
            raise fail("bench skew", f"{point.name}: need --top-k <= --num-experts, and --num-experts and "
                       f"--num-experts + --redundant-experts ({redundant}) divisible by the {ranks} ranks")
    return _run_cluster_grid("bench skew", run, summarize, grid, args)


def _add_exchange(benches: Any) -> None:
    exchange = benches.add_parser(
        "exchange", help="the ragged token exchange against the padded one (and the planner's pick) under set "
        "routing on an emulated cluster (needs root)",
        description="One expert-parallel layer with the padded exchange and kernel, the padded exchange with the "
        "ragged kernel, the ragged exchange and kernel, and token_exchange auto: training steps and "
        "inference forwards, round-robin, the slowest rank's medians, and each mode's all-to-all bytes. Each point "
        "is a routing distribution at a capacity factor, given as <skew>@<factor> (e.g. zipf:1.2@0 for dropless). "
        "Without --profile the ranks calibrate the cluster first.",
    )
    _add_cluster_layout(exchange, ranks_per_node=1)
    exchange.add_argument("--points", nargs="+", default=["uniform@1", "uniform@0", "zipf:1.2@0", "zipf:1.2@1"],
                          help="<skew>@<capacity factor> points (default: uniform@1 uniform@0 zipf:1.2@0 zipf:1.2@1)")
    _add_routed_layer(exchange, num_experts=8, model_dim=512, top_k=2)
    exchange.add_argument("--pipeline", type=pipeline_choice, default="auto",
                          help="every mode's pipeline: a policy, or one degree for all, run with the linear "
                          "all-to-all, so that only the exchange differs (default auto)")
    exchange.add_argument("--repeats", type=positive_int, default=5, help="timed iterations per mode (default 5)")
    exchange.set_defaults(func=run_exchange)


def pipeline_choice(text: str) -> int | str:
    """A ``pipeline`` setting from the command line: a policy name or a degree."""
    from moeflow.config import validate_pipeline

    try:
        return validate_pipeline(int(text) if text.isdigit() else text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run_exchange(args: argparse.Namespace) -> int:
    from moeflow.bench.exchange import ExchangePoint, run, summarize
    from moeflow.bench.skew import SkewPoint, routing_probabilities

    grid = []
    for text in args.points:
        skew, _, factor = text.partition("@")
        try:
            routing_probabilities(SkewPoint(skew, args.num_experts))
            capacity_factor = float(factor or 0.0)
        except ValueError as error:
            raise fail("bench exchange", f"--points {text!r}: {error}; write <skew>@<capacity factor>") from None
        grid.append(ExchangePoint(skew, capacity_factor, args.num_experts, args.hidden_dim, args.tokens,
                                  args.model_dim, args.top_k, args.pipeline))
    ranks = args.nodes * args.ranks_per_node
    if args.top_k > args.num_experts or args.num_experts % ranks:
        raise fail("bench exchange", f"need --top-k <= --num-experts and --num-experts divisible by the {ranks} ranks")
    return _run_cluster_grid("bench exchange", run, summarize, grid, args)


def _run_cluster_grid(command: str, run: Any, summarize: Any, grid: list[Any], args: argparse.Namespace) -> int:
    """Launch the emulated cluster for a grid benchmark and print its summary."""
    from moeflow.files import print_json
    from moeflow.testbed import ClusterError

    require_testbed(command)
    try:
        records = run(grid, args.nodes, args.ranks_per_node, args.inter_gbit, args.repeats, args.profile)
    except (ClusterError, RuntimeError) as error:
        raise fail(command, error) from None
    print_json(summarize(records))
    return 0


def _add_contention(benches: Any) -> None:
    contention = benches.add_parser(
        "contention", help="MoE all-to-alls against the gradient all-reduce (Lina): alone, beside it, DDP buckets, "
        "Lina's micro-ops; training steps per --grad-sync mode and per expert packing (emulated cluster, needs root)",
        description="links: the backward of --layers MoE layers with --allreduce-mb of gradients to all-reduce, the "
        "median all-to-all per mode. step: training steps of the default and a larger model under --grad-sync after, "
        "overlap and lina, round-robin, the slowest rank's median step time. packing: the same steps under lina with "
        "Lina's expert packing off and at each number of experts per worker its doubling reaches.",
    )
    _add_cluster_layout(contention, ranks_per_node=1)
    contention.add_argument("--kinds", nargs="+", default=["links", "step", "packing"],
                            choices=("links", "step", "packing"),
                            help="which measurements to make: links, step, packing (default all)")
    contention.add_argument("--models", nargs="+", default=["default", "large"], choices=("default", "large"),
                            help="step: the trainer's default model and/or a wider one (default both)")
    contention.add_argument("--microop-mb", nargs="+", type=float, default=[1.0],
                            help="Lina's micro-op sizes to measure, in MB (default 1)")
    contention.add_argument("--bucket-mb", type=float, default=1.0,
                            help="megabytes at which a gradient bucket of --grad-sync overlap closes (default 1)")
    contention.add_argument("--alltoall-mb", type=float, default=5.0,
                            help="links: megabytes in each all-to-all's buffer (default 5)")
    contention.add_argument("--allreduce-mb", type=float, default=8.0,
                            help="links: megabytes of gradients to all-reduce (default 8)")
    contention.add_argument("--steps", type=positive_int, default=5, help="step: timed steps per mode (default 5)")
    contention.add_argument("--repeats", type=positive_int, default=5, help="links: timed rounds, medians (default 5)")
    contention.set_defaults(func=run_contention)


def run_contention(args: argparse.Namespace) -> int:
    from moeflow.bench.contention import ContentionPoint, run, summarize

    if min(args.microop_mb) <= 0 or args.bucket_mb <= 0 or args.alltoall_mb <= 0 or args.allreduce_mb <= 0:
        raise fail("bench contention", "--microop-mb, --bucket-mb, --alltoall-mb and --allreduce-mb must be > 0")
    grid = []
    if "links" in args.kinds:
        grid += [ContentionPoint("links", alltoall_mb=args.alltoall_mb, allreduce_mb=args.allreduce_mb,
                                 microop_mb=size, bucket_mb=args.bucket_mb) for size in args.microop_mb]
    grid += [ContentionPoint(kind, model=model, microop_mb=size, bucket_mb=args.bucket_mb, steps=args.steps)
             for kind in ("step", "packing") if kind in args.kinds for model in args.models for size in args.microop_mb]
    return _run_cluster_grid("bench contention", run, summarize, grid, args)


# -- training -------------------------------------------------------------------------------------


def _add_train(benches: Any) -> None:
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
    return run(config, args.warmup)


# -- generation -----------------------------------------------------------------------------------


def _add_generate(benches: Any) -> None:
    generate = benches.add_parser(
        "generate", help="prefill and decode of transformers MoE models: moeflow vs transformers' experts (needs "
        "the hf extra; --workers 2 runs on an emulated cluster, needs root)",
        description="Random-weight Mixtral-like (E=8, k=2) and Qwen3-MoE-like (E=64, k=8) models generate greedily "
        "with a KV cache; moeflow and transformers' eager and grouped_mm experts take turns on the same weights. "
        "--workers 2: expert parallel on the emulated 2x1 cluster, the all-to-all share of a decode step at "
        "pipeline degrees 1 and 2.",
    )
    generate.add_argument("--models", nargs="+", default=["mixtral", "qwen3"], choices=("mixtral", "qwen3"),
                          help="Mixtral-like (E=8, k=2) and/or Qwen3-MoE-like (E=64, k=8) (default both)")
    generate.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 8, 32],
                          help="batch sizes to time, sequences per worker (default 1 8 32)")
    generate.add_argument("--prompt-tokens", type=positive_int, default=32, help="prompt length in tokens (default 32)")
    generate.add_argument("--new-tokens", type=positive_int, default=16,
                          help="tokens generated per sequence (default 16)")
    generate.add_argument("--repeats", type=positive_int, default=3, help="timed generations each (default 3)")
    generate.add_argument("--workers", type=positive_int, default=1, choices=(1, 2),
                          help="processes: 1 runs here; 2 runs expert parallel on the emulated 2x1 cluster (default 1)")
    generate.add_argument("--inter-gbit", type=float, default=1.0,
                          help="--workers 2: bandwidth between nodes, Gbit/s (default 1)")
    generate.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench.generate import GeneratePoint, measure_point, read_bandwidth, run_cluster, summarize
    from moeflow.files import print_json

    if args.new_tokens < 2:
        raise fail("bench generate", f"--new-tokens {args.new_tokens} leaves no decode step to time; use 2 or more")
    grid = [GeneratePoint(model, batch, args.prompt_tokens, args.new_tokens)
            for model in args.models for batch in args.batch_sizes]
    if args.workers == 2:
        require_testbed("bench generate")
        from moeflow.testbed import ClusterError

        try:
            records = run_cluster(grid, 2, 1, args.inter_gbit, args.repeats)
        except (ClusterError, RuntimeError) as error:
            raise fail("bench generate", error) from None
        share = [r["alltoall_share"] for r in records]
        print_json({"summary": "generate-expert-parallel", "records": len(records),
                    "max_alltoall_share": max(share) if share else None})
        return 0
    torch.set_num_threads(1)
    bandwidth = read_bandwidth()
    records = []
    for point in grid:
        for record in measure_point(point, args.repeats, bandwidth):
            print_json(record)
            records.append(record)
    print_json(summarize(records))
    return 0


# -- lina-inference -------------------------------------------------------------------------------


def _add_lina_inference(benches: Any) -> None:
    parser = benches.add_parser(
        "lina-inference", help="Lina's inference scheduling: static, lina, oracle and ideal batch times (needs root)",
        description="On the emulated cluster, every worker runs batches of sequences under the static placement, "
        "Lina's estimate-then-fine-tune schedule, the oracle (gate counts) and the ideal (a balanced gate), the same "
        "batches for each: median and p95 batch times over ideal's, the estimate's accuracy per layer and the "
        "path-length ablation. Models: a moeflow train checkpoint (--checkpoint) and random Mixtral-like models "
        "with skewed (popular experts spread, or colocated on one worker) and uniform routers.",
    )
    parser.add_argument("--models", nargs="+", default=["trained", "skewed", "colocated", "uniform"],
                        choices=("trained", "skewed", "colocated", "uniform"),
                        help="the models to schedule: trained (needs --checkpoint), skewed, colocated, uniform "
                        "(default all)")
    parser.add_argument("--checkpoint", default=None, help="a moeflow train run folder (the trained model)")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per worker per batch (default 4)")
    parser.add_argument("--context", type=positive_int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batches", type=positive_int, default=20, help="timed batches per schedule (default 20)")
    parser.add_argument("--max-experts-per-rank", type=positive_int, default=8,
                        help="Lina's packing limit (default 8: E=8 on 2 workers leaves room to balance)")
    parser.add_argument("--replica-slots", type=int, default=None, metavar="R",
                        help="a memory budget for lina and oracle: each worker keeps its own experts and computes "
                        "at most R copies of others, made where the calibrated cost model says they pay (the "
                        "cluster is calibrated first unless --profile; default: Lina's packing up to "
                        "--max-experts-per-rank)")
    parser.add_argument("--plot", metavar="PNG",
                        help="write the Fig. 16-style plot of the times over ideal's to this PNG")
    _add_cluster_layout(parser, 1)
    parser.set_defaults(func=run_lina_inference)


def run_lina_inference(args: argparse.Namespace) -> int:
    from moeflow.bench.lina_inference import LinaPoint, run_cluster, summarize
    from moeflow.files import print_json

    if "trained" in args.models and args.checkpoint is None:
        raise fail("bench lina-inference", "the trained model needs --checkpoint RUN_DIR (a moeflow train run), or "
                   "leave it out: --models skewed uniform")
    require_testbed("bench lina-inference")
    from moeflow.testbed import ClusterError

    points = [LinaPoint(model, args.checkpoint or "", args.batch, args.context, args.batches,
                        max_experts_per_rank=args.max_experts_per_rank, replica_slots=args.replica_slots)
              for model in args.models]
    try:
        records = run_cluster(points, args.nodes, args.ranks_per_node, args.inter_gbit, args.profile)
    except (ClusterError, RuntimeError) as error:
        raise fail("bench lina-inference", error) from None
    if args.plot:
        from moeflow.bench.lina_plot import plot_lina_inference

        plot_lina_inference(records, args.plot)
    print_json(summarize(records))
    return 0


def _add_simulator(benches: Any) -> None:
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
    sim.set_defaults(func=run_simulator)


def run_simulator(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from moeflow.bench.sim_validation import BENCHES, GRID, run, summarize
    from moeflow.files import print_json
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
            records = run(layouts, bandwidths, list(GRID), args.repeats, folder, print_json, benches)
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


def _add_papers(benches: Any) -> None:
    from moeflow.bench.paper_trends import TRENDS

    papers = benches.add_parser(
        "papers", help="the papers' trends simulated on their cluster profiles, beside the published numbers",
        description="Tutel Table 6 and Fig. 14, PipeMoE Table VI, FasterMoE Fig. 13, Lina's all-to-all under "
        "contention: one JSON line per cell (simulated, published, their ratio) and a summary per table.",
    )
    papers.add_argument("--only", nargs="+", choices=sorted(TRENDS), default=None,
                        help="simulate only these tables (default all)")
    papers.add_argument("--plot", default=None, metavar="FOLDER", help="write one bar chart per table into this folder")
    papers.set_defaults(func=run_papers)


def run_papers(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moeflow.bench.paper_trends import TRENDS, plot, summarize
    from moeflow.files import print_json

    rows = []
    for name in args.only or TRENDS:
        for row in TRENDS[name]():
            print_json(row)
            rows.append(row)
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)
        for path in plot(rows, Path(args.plot)):
            print_json({"plot": str(path)})
    print_json(summarize(rows))
    return 0


# -- memory ---------------------------------------------------------------------------------------


def _add_memory(benches: Any) -> None:
    from moeflow.bench.memory import SCENARIOS  # no torch at import

    memory = benches.add_parser(
        "memory", help="each worker's peak resident memory against the memory it must hold, for generation and "
        "for training with a checkpoint save and resume (generation needs the hf extra)",
        description="Per worker: the peak resident memory minus that of a process that only imports torch, "
        "transformers and moeflow, over its share (the non-expert parameters plus this rank's experts; in training "
        "16 bytes per such parameter plus one batch's activations). generation: moeflow generate --hf's workers on a "
        "random Mixtral-like model saved with save_pretrained. scheduled-generation: the same with Lina's per-batch "
        "expert placement (the oracle popularity; a worker fetches the experts it computes but does not store). "
        "training: moeflow train's workers for --steps steps "
        "and a checkpoint, then a resume from it for --steps more. Each record also gives the peak of a process that "
        "imports every module the workers loaded (imports_bytes: the code's own part of the peak) and the ratio above "
        "it.",
    )
    memory.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                        help=f"what to measure (default all: {' '.join(SCENARIOS)})")
    memory.add_argument("--workers", type=positive_int, nargs="+", default=[1, 2, 4],
                        help="gloo worker counts to measure, each must divide --num-experts (default 1 2 4)")
    memory.add_argument("--layers", type=positive_int, default=4,
                        help="decoder layers, each with an MoE block (default 4)")
    memory.add_argument("--model-dim", type=positive_int, default=512,
                        help="model dimension M, a multiple of the 4 attention heads (default 512)")
    memory.add_argument("--hidden-dim", type=positive_int, default=2048, help="expert hidden size H (default 2048)")
    memory.add_argument("--num-experts", type=positive_int, default=8, help="number of experts E (default 8)")
    memory.add_argument("--steps", type=positive_int, default=3,
                        help="training steps before the checkpoint, and again after the resume (default 3)")
    memory.add_argument("--data", default=None,
                        help="training: a folder or file of text to train on (default: the trainer's, Python's "
                        "standard library)")
    memory.add_argument("--vocab-size", type=positive_int, default=4096,
                        help="training: the tokenizer's vocabulary size (default 4096)")
    memory.add_argument("--skip-imports", action="store_true",
                        help="skip the process that imports what the workers loaded (the code's own share of the "
                        "peak), which takes a few seconds per scenario")
    memory.set_defaults(func=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    from moeflow.bench.memory import HEADS, MemoryBenchConfig, is_generation, run, training_config

    uneven = [w for w in args.workers if args.num_experts % w]
    if uneven:
        raise fail("bench memory", f"--num-experts {args.num_experts} is not divisible by --workers {uneven}: the "
                   "experts are split evenly over the workers")
    if args.model_dim % HEADS:
        raise fail("bench memory", f"--model-dim {args.model_dim} must be a multiple of the {HEADS} attention heads")
    if args.num_experts < 2:
        raise fail("bench memory", "--num-experts must be at least 2 (the models route each token to 2 experts)")
    if any(is_generation(s) for s in args.scenarios) and importlib.util.find_spec("transformers") is None:
        raise fail("bench memory", "the generation scenario needs transformers: pip install 'moeflow[hf]', or "
                   "--scenarios training")
    config = MemoryBenchConfig(
        scenarios=tuple(dict.fromkeys(args.scenarios)), workers=tuple(dict.fromkeys(args.workers)),
        layers=args.layers, model_dim=args.model_dim, hidden_dim=args.hidden_dim, num_experts=args.num_experts,
        steps=args.steps, data=args.data, vocab_size=args.vocab_size, imports=not args.skip_imports,
    )
    try:
        if "training" in config.scenarios:  # the trainer's own checks, before anything runs
            for workers in config.workers:
                training_config(config, workers, Path("unused"))
        return run(config)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        raise fail("bench memory", error) from None


# -- faults ---------------------------------------------------------------------------------------


def _add_faults(benches: Any) -> None:
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
    faults.set_defaults(func=run_faults)


def run_faults(args: argparse.Namespace) -> int:
    from moeflow.bench.faults import DELAY_S, run

    if args.collective_timeout_s <= DELAY_S:
        raise fail("bench faults", f"--collective-timeout-s {args.collective_timeout_s} must exceed the drill's "
                   f"{DELAY_S:g} s delay (a delay shorter than the timeout must not fail the job)")
    return run(args.collective_timeout_s, args.resume, tuple(args.kinds))
