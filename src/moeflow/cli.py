"""The ``moeflow`` command line. Subcommands import what they need lazily, so ``--help`` is fast."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeflow", description="Fast distributed Mixture-of-Experts training and inference."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    from moeflow.training.cli import add_train_parser

    add_train_parser(commands)
    bench = commands.add_parser("bench", help="run a benchmark (prints JSON lines and a summary)")
    benches = bench.add_subparsers(dest="bench", required=True)
    layer = benches.add_parser(
        "layer", help="MoELayer vs the plain reference and the FLOP floor, forward+backward",
        description="Without --experts/--hidden-dim it measures the two target shapes "
        "(E=8, H=2048) and (E=64, H=256).",
    )
    layer.add_argument("--tokens", type=int, default=4096, help="tokens per worker (default 4096)")
    layer.add_argument("--model-dim", type=_positive_int, default=512)
    layer.add_argument("--hidden-dim", type=_positive_int, default=None)
    layer.add_argument("--experts", type=_positive_int, default=None)
    layer.add_argument("--top-k", type=_positive_int, default=2)
    layer.add_argument("--capacity-factor", type=float, default=1.0)
    layer.add_argument("--activation", default="gelu", choices=("relu", "gelu", "silu", "swiglu"))
    layer.add_argument("--workers", type=_positive_int, default=1,
                       help="gloo worker processes, one intra-op thread each (default 1)")
    layer.add_argument("--repeats", type=_positive_int, default=5)
    layer.add_argument("--warmup", type=int, default=1)
    layer.add_argument("--no-kernels", action="store_true", help="skip timing each expert kernel alone")
    alltoall = benches.add_parser(
        "alltoall", help="linear vs 2DH vs pairwise all-to-all on emulated clusters (needs root)",
    )
    alltoall.add_argument("--layouts", nargs="+", default=["2x2", "4x2", "1x4"],
                          help="NODESxRANKS_PER_NODE, default 2x2 4x2 1x4")
    alltoall.add_argument("--sizes", type=_positive_int, nargs="+", default=None,
                          help="bytes per destination (default 1 KiB .. 1 MiB)")
    alltoall.add_argument("--inter-gbit", type=float, default=1.0)
    alltoall.add_argument("--inter-latency-us", type=float, default=100.0)
    alltoall.add_argument("--repeats", type=_positive_int, default=7)
    pipeline = benches.add_parser(
        "pipeline", help="fixed pipeline degrees and all-to-alls vs the planner on an emulated cluster (needs root)",
        description="Grid: the product of the list options (default 32 configurations, from communication-bound "
        "H=256 to computation-bound H=1024 at 1 Gbit/s). Without --profile the ranks calibrate the cluster first.",
    )
    pipeline.add_argument("--nodes", type=_positive_int, default=2)
    pipeline.add_argument("--ranks-per-node", type=_positive_int, default=2)
    pipeline.add_argument("--inter-gbit", type=float, default=1.0)
    pipeline.add_argument("--tokens", type=_positive_int, nargs="+", default=[512, 1024], help="tokens per rank")
    pipeline.add_argument("--model-dims", type=_positive_int, nargs="+", default=[256, 512])
    pipeline.add_argument("--hidden-dims", type=_positive_int, nargs="+", default=[256, 1024])
    pipeline.add_argument("--experts-per-rank", type=_positive_int, nargs="+", default=[1, 2])
    pipeline.add_argument("--top-k", type=_positive_int, nargs="+", default=[1, 2])
    pipeline.add_argument("--repeats", type=_positive_int, default=3)
    pipeline.add_argument("--profile", default=None, help="a profile of this cluster (skips calibration)")
    schedules = benches.add_parser(
        "schedules", help="replicated experts vs expert parallelism as whole training steps on an emulated cluster, "
        "and what parallel='auto' picks (needs root)",
        description="Grid: --experts x --hidden-dims at --tokens tokens per rank (a one-block MoE transformer). "
        "Without --profile the ranks calibrate the cluster first.",
    )
    schedules.add_argument("--nodes", type=_positive_int, default=2, help="emulated nodes (default 2)")
    schedules.add_argument("--ranks-per-node", type=_positive_int, default=1,
                           help="ranks per node (default 1: one rank per core on 2 cores)")
    schedules.add_argument("--inter-gbit", type=float, default=1.0, help="bandwidth between nodes, Gbit/s")
    schedules.add_argument("--experts", type=_positive_int, nargs="+", default=[2, 4, 8],
                           help="numbers of experts E to try")
    schedules.add_argument("--hidden-dims", type=_positive_int, nargs="+", default=[64, 256, 1024],
                           help="expert hidden sizes H to try")
    schedules.add_argument("--model-dim", type=_positive_int, default=256, help="model dimension M")
    schedules.add_argument("--batch", type=_positive_int, default=8, help="sequences per rank and step")
    schedules.add_argument("--context", type=_positive_int, default=128, help="tokens per sequence")
    schedules.add_argument("--repeats", type=_positive_int, default=5, help="timed steps per schedule (medians)")
    schedules.add_argument("--profile", default=None, help="a profile of this cluster (skips calibration)")
    train_bench = benches.add_parser(
        "train", help="model FLOPs utilization and the MoE layers' non-GEMM share of the default training run",
        description="Trains the default model (or --config) for --steps steps on --workers workers, then measures "
        "the matmul throughput of the same workers; medians over the steps after --warmup.",
    )
    train_bench.add_argument("--steps", type=_positive_int, default=40)
    train_bench.add_argument("--warmup", type=int, default=15, help="steps left out (planner trials, warm-up)")
    train_bench.add_argument("--workers", type=_positive_int, default=None, help="default: the config's (2)")
    train_bench.add_argument("--config", default=None, help="a TOML, YAML or JSON file of training settings")
    calibrate = commands.add_parser(
        "calibrate", help="fit alpha-beta cost models (GEMM, collectives, interference); write a profile",
        description="Locally it spawns --workers gloo workers; under moeflow launch or torchrun it uses the "
        "launched ranks (rank 0 writes the profile).",
    )
    calibrate.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    calibrate.add_argument("--workers", type=_positive_int, default=2)
    calibrate.add_argument("--model-dim", type=_positive_int, default=512)
    calibrate.add_argument("--hidden-dim", type=_positive_int, default=1024)
    calibrate.add_argument("--repeats", type=_positive_int, default=5)
    plan = commands.add_parser("plan", help="predicted times of an MoE layer from a calibrated profile")
    plan.add_argument("--profile", required=True)
    plan.add_argument("--tokens", type=_positive_int, default=4096, help="tokens per rank")
    plan.add_argument("--model-dim", type=_positive_int, default=512)
    plan.add_argument("--hidden-dim", type=_positive_int, default=1024)
    plan.add_argument("--experts", type=_positive_int, default=8)
    plan.add_argument("--top-k", type=_positive_int, default=2)
    plan.add_argument("--capacity-factor", type=float, default=1.0)
    plan.add_argument("--max-degree", type=_positive_int, default=16)
    plan.add_argument("--forward-only", action="store_true", help="plan for inference (no backward pass)")
    _add_cluster_arguments(commands.add_parser(
        "launch", help="run a command as every rank of an emulated multi-node cluster (needs root)",
        description="Example: moeflow launch --nodes 2 --ranks-per-node 2 --inter-gbit 1 -- "
        "python -m moeflow bench layer",
    ), launch=True)
    cluster = commands.add_parser(
        "cluster", help="create an emulated cluster, probe its links, print JSON, tear it down (needs root)"
    )
    _add_cluster_arguments(cluster, launch=False)
    cluster.add_argument("--cleanup", action="store_true", help="only delete namespaces left by killed runs")
    return parser


def _add_cluster_arguments(parser: argparse.ArgumentParser, launch: bool) -> None:
    parser.add_argument("--nodes", type=_positive_int, default=2)
    parser.add_argument("--ranks-per-node", type=_positive_int, default=2)
    parser.add_argument("--inter-gbit", type=float, default=1.0, help="inter-node bandwidth per node (Gbit/s)")
    parser.add_argument("--inter-latency-us", type=float, default=0.0,
                        help="one-way inter-node latency (needs the kernel's sch_netem)")
    parser.add_argument("--inter-jitter-us", type=float, default=0.0)
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--timeout", type=float, default=None, help="stop every rank after this many seconds")
    if launch:
        parser.add_argument("rank_command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")


def _cluster_spec(args: argparse.Namespace):  # -> ClusterSpec (imported lazily)
    from moeflow.testbed import ClusterSpec

    try:
        return ClusterSpec(args.nodes, args.ranks_per_node, args.inter_gbit, args.inter_latency_us,
                           args.inter_jitter_us)
    except ValueError as error:
        raise SystemExit(f"moeflow {args.command}: {error}") from None


def _launch(args: argparse.Namespace) -> int:
    from moeflow.testbed import ClusterError, launch

    command = args.rank_command[1:] if args.rank_command[:1] == ["--"] else args.rank_command
    if not command:
        raise SystemExit("moeflow launch: give the command to run after --, e.g. -- python train.py")
    try:
        return launch(_cluster_spec(args), command, master_port=args.master_port, timeout_s=args.timeout)
    except ClusterError as error:
        raise SystemExit(f"moeflow launch: {error}") from None


def _cluster(args: argparse.Namespace) -> int:
    import subprocess

    from moeflow.testbed import ClusterError, launch, stale_namespaces, unavailable_reason

    if args.cleanup:
        reason = unavailable_reason()
        if reason:
            raise SystemExit(f"moeflow cluster: {reason}")
        stale = stale_namespaces()
        for name in stale:
            subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)
        print(f"deleted {len(stale)} stale namespace(s): {' '.join(stale) or '-'}")
        return 0
    try:
        return launch(_cluster_spec(args), [sys.executable, "-m", "moeflow.testbed.probe"],
                      master_port=args.master_port, timeout_s=args.timeout or 120)
    except ClusterError as error:
        raise SystemExit(f"moeflow cluster: {error}") from None


def _calibrate(args: argparse.Namespace) -> int:
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
        config = replace(config, ranks_per_node=int(per_node) if per_node else None)
        profile = calibrate_from_env(config)
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


def _plan(args: argparse.Namespace) -> int:
    from moeflow.bench import print_json
    from moeflow.comm.algorithms import ALGORITHMS
    from moeflow.perf import ClusterProfile, CostModel, LayerShape
    from moeflow.perf.pipeline import RegionShape, predict_plan, rank_plans, theorem1_for_shape, usable_degrees

    try:
        profile = ClusterProfile.load(args.profile)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"moeflow plan: {error}") from None
    model = CostModel(profile)
    if args.top_k > args.experts or args.experts % model.world_size:
        raise SystemExit(f"moeflow plan: need top_k <= experts and experts divisible by {model.world_size} ranks")
    if "gemm" not in profile.fits:
        raise SystemExit("moeflow plan: the profile has no gemm fit; re-run moeflow calibrate")
    shape = LayerShape(args.tokens, args.model_dim, args.hidden_dim, args.experts, args.top_k, args.capacity_factor)
    region = RegionShape(args.experts, model.world_size, shape.capacity(), args.model_dim, args.hidden_dim)
    algorithms = [a for a in ALGORITHMS if f"alltoall.{a}" in profile.fits] if model.world_size > 1 else ["linear"]
    backward = not args.forward_only
    for algorithm in algorithms:
        for degree in usable_degrees(range(1, args.max_degree + 1), region.capacity):
            p = predict_plan(model, region, degree, algorithm, backward)
            print_json({"plan": "pipeline", "alltoall": algorithm, "degree": degree, "forward_ms": p.forward_s * 1e3,
                        "backward_ms": p.backward_s * 1e3, "total_ms": p.total_s * 1e3})
        if model.world_size > 1:
            choice = theorem1_for_shape(model, region, algorithm, args.max_degree)
            print_json({"plan": "theorem1", "alltoall": algorithm, "degree": choice.degree, "case": choice.case,
                        "forward_ms": choice.predicted_s * 1e3})
    best = rank_plans(model, region, range(1, args.max_degree + 1), algorithms, backward)[0]
    replicated = _print_replicated_plan(model, region, backward)
    roofline = model.layer_times(shape, best.algorithm, backward)
    unpipelined = predict_plan(model, region, 1, best.algorithm, backward)
    print_json({
        "summary": "plan", "alltoall": best.algorithm, "degree": best.degree,
        "schedule": "replicated" if replicated is not None and replicated.total_s < best.total_s else "expert",
        "expert_memory_mb": best.expert_memory_bytes / 2**20,
        "predicted_ms": best.total_s * 1e3, "predicted_d1_ms": unpipelined.total_s * 1e3,
        "r_cc": roofline["r_cc"], "ideal_ms": roofline["ideal_s"] * 1e3, "semi_ideal_ms": roofline["serial_s"] * 1e3,
        "ideal_fraction_of_peak": roofline["ideal_fraction_of_peak"],
        "semi_ideal_fraction_of_peak": roofline["semi_ideal_fraction_of_peak"],
        "world_size": model.world_size, "capacity": region.capacity, "backward": backward,
    })
    return 0


def _print_replicated_plan(model: Any, region: Any, backward: bool) -> Any:
    """The replicated schedule's prediction line (with the gradient all-reduce it adds to training)."""
    from moeflow.bench import print_json
    from moeflow.perf.schedules import SCHEDULE_MODELS

    schedule = SCHEDULE_MODELS["replicated"]
    if not schedule.can_predict(model):
        return None
    (plan,) = schedule.candidates(region, (), ())
    p = schedule.predict(plan, model, region, backward)
    print_json({"plan": "replicated", "forward_ms": p.forward_s * 1e3, "backward_ms": p.backward_s * 1e3,
                "gradient_sync_ms": p.gradient_sync_s * 1e3, "total_ms": p.total_s * 1e3,
                "expert_memory_mb": p.expert_memory_bytes / 2**20})
    return p


def _bench_pipeline(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench import print_json
    from moeflow.bench.pipeline import GridPoint, run, summarize
    from moeflow.testbed import ClusterError, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"moeflow bench pipeline: {reason}")
    grid = [GridPoint(*values) for values in itertools.product(
        args.tokens, args.model_dims, args.hidden_dims, args.experts_per_rank, args.top_k)]
    try:
        records = run(grid, args.nodes, args.ranks_per_node, args.inter_gbit, args.repeats, args.profile)
    except (ClusterError, RuntimeError) as error:
        raise SystemExit(f"moeflow bench pipeline: {error}") from None
    print_json(summarize(records))
    return 0


def _bench_schedules(args: argparse.Namespace) -> int:
    import itertools

    from moeflow.bench import print_json
    from moeflow.bench.schedules import SchedulePoint, run, summarize
    from moeflow.testbed import ClusterError, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"moeflow bench schedules: {reason}")
    grid = [SchedulePoint(e, h, args.model_dim, args.batch, args.context)
            for e, h in itertools.product(args.experts, args.hidden_dims)]
    try:
        records = run(grid, args.nodes, args.ranks_per_node, args.inter_gbit, args.repeats, args.profile)
    except (ClusterError, RuntimeError) as error:
        raise SystemExit(f"moeflow bench schedules: {error}") from None
    print_json(summarize(records))
    return 0


def _bench_alltoall(args: argparse.Namespace) -> int:
    from moeflow.bench import print_json
    from moeflow.bench.alltoall import DEFAULT_SIZES, run, summarize
    from moeflow.testbed import ClusterError, unavailable_reason

    layouts = []
    for text in args.layouts:
        nodes, _, per_node = text.partition("x")
        if not (nodes.isdigit() and per_node.isdigit() and int(nodes) >= 1 and int(per_node) >= 1):
            raise SystemExit(f"moeflow bench alltoall: --layouts takes NODESxRANKS like 2x2, got {text!r}")
        layouts.append((int(nodes), int(per_node)))
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"moeflow bench alltoall: {reason}")
    try:
        results = run(layouts, list(args.sizes or DEFAULT_SIZES), args.inter_gbit, args.inter_latency_us,
                      args.repeats)
    except (ClusterError, RuntimeError) as error:
        raise SystemExit(f"moeflow bench alltoall: {error}") from None
    print_json(summarize(results))
    return 0


def _bench_layer(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench import print_json
    from moeflow.bench.layer import DEFAULT_SHAPES, LayerBenchConfig, measure_layer, slowest_worker, summarize
    from moeflow.distributed import run_distributed

    if args.tokens < 0:
        raise SystemExit(f"moeflow bench layer: --tokens must be >= 0, got {args.tokens}")
    if (args.experts is None) != (args.hidden_dim is None):
        shapes = [(args.experts or 8, args.hidden_dim or 2048)]
    elif args.experts is None:
        shapes = list(DEFAULT_SHAPES)
    else:
        shapes = [(args.experts, args.hidden_dim)]
    results = []
    for experts, hidden in shapes:
        if args.top_k > experts:
            raise SystemExit(f"moeflow bench layer: --top-k {args.top_k} exceeds --experts {experts}")
        if experts % args.workers:
            raise SystemExit(
                f"moeflow bench layer: --experts {experts} is not divisible by --workers {args.workers}"
            )
        config = LayerBenchConfig(
            tokens=args.tokens, model_dim=args.model_dim, hidden_dim=hidden, experts=experts,
            top_k=args.top_k, capacity_factor=args.capacity_factor, activation=args.activation,
            repeats=args.repeats, warmup=args.warmup, measure_kernels=not args.no_kernels,
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


def _bench_train(args: argparse.Namespace) -> int:
    from moeflow.bench.train import run
    from moeflow.training.config import TrainConfig, load_config_file

    try:
        values = load_config_file(args.config) if args.config else {}
        values["steps"] = args.steps
        if args.workers is not None:
            values["workers"] = args.workers
        config = TrainConfig(**{**values, "stop_at": None})
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"moeflow bench train: {error}") from None
    return run(config, args.warmup)


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    import os

    from moeflow.runtime import tune_cpu_allocator, tuning_requested

    tune_cpu_allocator(tuning_requested(os.environ))
    if args.command in ("train", "report", "generate"):
        from moeflow.training import cli as training_cli

        return {"train": training_cli.run_train, "report": training_cli.run_report,
                "generate": training_cli.run_generate}[args.command](args)
    if args.command == "bench" and args.bench == "train":
        return _bench_train(args)
    if args.command == "bench" and args.bench == "layer":
        return _bench_layer(args)
    if args.command == "bench" and args.bench == "alltoall":
        return _bench_alltoall(args)
    if args.command == "bench" and args.bench == "pipeline":
        return _bench_pipeline(args)
    if args.command == "bench" and args.bench == "schedules":
        return _bench_schedules(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "launch":
        return _launch(args)
    if args.command == "cluster":
        return _cluster(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
