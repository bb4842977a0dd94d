"""``moeflow simulate``: one training step (or inference batch) of an MoE transformer on a simulated
cluster, for every requested plan (schedule x pipeline degree x all-to-all algorithm), pipelined
over stages with ``--pp-size``; one JSON line per plan and a summary naming the fastest."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from typing import Any

from moeflow.commands import add_progress_flag, add_renamed_flag, fail, positive_int, show_progress
from moeflow.pipeline.layout import SCHEDULES


def add_parser(commands: Any) -> None:
    sim = commands.add_parser("simulate", help="simulate a training step or inference batch on a cluster profile")
    sim.add_argument("--cluster", default=None,
                     help="a shipped profile's name (see --list), a TOML profile, or a moeflow calibrate JSON")
    sim.add_argument("--model", default=None, help="a shipped model's name or a TOML model file (default: moeflow's)")
    sim.add_argument("--list", action="store_true", help="print the shipped cluster and model profiles and exit")
    for name, kind, text in (
        ("layers", positive_int, "number of MoE transformer layers"), ("num-experts", positive_int, "experts E"),
        ("model-dim", positive_int, "model dimension M"), ("hidden-dim", positive_int, "expert hidden size H"),
        ("top-k", positive_int, "experts per token k"), ("tokens-per-rank", positive_int, "tokens per rank T"),
        ("capacity-factor", float, "capacity factor f (Tutel's)"),
        ("routing", str, "routing: uniform, zipf:<s>, one-hot or a trace file (.npy, .json)"),
    ):
        sim.add_argument(f"--{name}", type=kind, default=None, help=f"override the model's {text}")
    add_renamed_flag(sim, "--experts", "--num-experts", type=positive_int)
    sim.add_argument("--nodes", type=positive_int, default=None, help="resize the cluster to this many nodes")
    sim.add_argument("--gpus-per-node", type=positive_int, default=None, help="override the cluster's GPUs per node")
    sim.add_argument("--schedule", default="expert",
                     help="comma list of simulated schedules (the registry's; default expert)")
    sim.add_argument("--mp", type=positive_int, default=1,
                     help="tensor-parallel attention over this many ranks of a node (Parm's schedules; default 1)")
    sim.add_argument("--esp", type=positive_int, default=1,
                     help="each expert sharded over this many ranks of a node (Parm's schedules; default 1)")
    sim.add_argument("--degree", default="1", help="comma list of pipeline degrees to simulate (default 1)")
    sim.add_argument("--algorithm", default="linear",
                     help="comma list of all-to-all algorithms to simulate: linear, 2dh, pairwise "
                     "(default linear)")
    sim.add_argument("--allreduce", default="auto", choices=("auto", "ring", "tree"),
                     help="the gradient all-reduce's algorithm: ring, tree, or auto (the faster alone, as NCCL's "
                     "tuner picks; default auto)")
    sim.add_argument("--pp-size", type=positive_int, default=1,
                     help="pipeline parallelism: the blocks in stages over this many groups of consecutive ranks, "
                     "priced from one stage's simulated micro-batch and the schedule's orders (default 1: none)")
    sim.add_argument("--pp-schedule", default="1f1b", choices=tuple(SCHEDULES),
                     help="with --pp-size: the pipeline schedule (default 1f1b)")
    sim.add_argument("--microbatches", type=positive_int, default=None,
                     help="with --pp-size: micro-batches a step; they divide a data rank's tokens (--tokens-per-rank x "
                     "--pp-size) and are at least the "
                     "schedule's stage count (default: that count)")
    sim.add_argument("--pp-overlap", action="store_true",
                     help="with --pp-schedule dualpipev: each paired forward and backward hide each other's "
                     "all-to-alls (DualPipe's ideal overlap)")
    sim.add_argument("--prioritize-alltoall", action="store_true",
                     help="all-to-alls take the links before the gradient all-reduce (Lina)")
    sim.add_argument("--inference", action="store_true", help="one forward batch instead of a training step")
    sim.add_argument("--scaling", action="store_true",
                     help="time the simulator itself at 4..256 nodes and 8..64 layers for the first plan")
    add_progress_flag(sim)
    sim.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeflow.progress import progress_bar
    from moeflow.sim import ClusterFileError, StepPlan, load_cluster, load_model, named_clusters, named_models

    if args.list:
        print(json.dumps({"clusters": named_clusters(), "models": named_models()}))
        return 0
    if args.cluster is None:
        raise fail("simulate", "--cluster is required: a shipped profile (see --list), a TOML file or a calibrate JSON")
    try:
        cluster = load_cluster(args.cluster)
        if args.nodes or args.gpus_per_node:
            cluster = cluster.resized(args.nodes or cluster.nodes, args.gpus_per_node)
        model = load_model(args.model).with_overrides(
            layers=args.layers, num_experts=args.num_experts, model_dim=args.model_dim, hidden_dim=args.hidden_dim,
            top_k=args.top_k, tokens_per_rank=args.tokens_per_rank, capacity_factor=args.capacity_factor,
            routing=args.routing)
        pipeline = _pipeline_knobs(args, cluster, model)
        plans = [StepPlan(schedule, degree, algorithm, args.allreduce, args.prioritize_alltoall, mp=args.mp,
                          esp=args.esp, **pipeline)
                 for schedule, degree, algorithm in itertools.product(
                     _words(args.schedule), [_degree(d) for d in _words(args.degree)], _words(args.algorithm))]
        plans = _unique(plans)
    except (ClusterFileError, ValueError, FileNotFoundError) as error:
        raise fail("simulate", error) from None
    if args.scaling:
        return _scaling(cluster, model, plans[0], show_progress(args))
    results = []
    with progress_bar("simulate", "plan", len(plans), enabled=show_progress(args)) as progress:
        for plan in plans:
            results.append(_simulate(cluster, model, plan, not args.inference))
            progress.advance()
    best = min(results, key=lambda r: r["step_ms"])
    print(f"# {cluster.name}: {cluster.nodes} x {cluster.gpus_per_node} = {cluster.world_size} ranks, {model.name} "
          f"{model.layers} layers; best {best['plan']} at {best['step_ms']:.4g} ms per "
          f"{'batch' if args.inference else 'step'}")
    return 0


def _pipeline_knobs(args: argparse.Namespace, cluster: Any, model: Any) -> dict[str, Any]:
    """The plans' pipeline knobs from the flags; a flag that needs --pp-size, that the pipelined
    step refuses or that does not fit the cluster and model is named, with the fix."""
    from moeflow.perf.sim.plan import schedule_stages
    from moeflow.sim.pipelined import data_rank_tokens, pipeline_sizes

    if args.pp_size == 1:
        given = [flag for flag, value in (("--pp-schedule", args.pp_schedule != "1f1b"),
                                          ("--microbatches", args.microbatches is not None),
                                          ("--pp-overlap", args.pp_overlap)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} shape a pipelined step: add --pp-size N (N > 1), or drop them")
        return {}
    if args.inference:
        raise ValueError("--pp-size prices a pipelined training step: drop --inference or --pp-size")
    if args.pp_overlap and args.pp_schedule != "dualpipev":
        raise ValueError(f"--pp-overlap overlaps DualPipeV's paired forward and backward: add --pp-schedule "
                         f"dualpipev (not {args.pp_schedule}), or drop --pp-overlap")
    if args.mp > 1 or args.esp > 1 or args.prioritize_alltoall:
        raise ValueError("--pp-size runs as moeflow's pipelined trainer: --mp 1, --esp 1, the gradient sync once "
                         "after the pipeline drains (no --prioritize-alltoall); drop those flags or --pp-size")
    sizes = pipeline_sizes(cluster)
    if args.pp_size not in sizes:
        raise ValueError(f"--pp-size {args.pp_size} must split the {cluster.nodes} x {cluster.gpus_per_node} ranks "
                         f"into stages of consecutive ranks that tile the nodes: use one of {sizes[1:]}")
    stages = schedule_stages(args.pp_schedule, args.pp_size)
    if model.layers < stages:
        raise ValueError(f"--pp-size {args.pp_size} --pp-schedule {args.pp_schedule} makes {stages} stages and the "
                         f"model has {model.layers} layers: use more --layers, a smaller --pp-size or a schedule of "
                         "one stage per rank (1f1b, gpipe)")
    microbatches, tokens = args.microbatches or stages, data_rank_tokens(model, args.pp_size)
    if microbatches < stages or tokens % microbatches:
        raise ValueError(f"--microbatches {microbatches} must be at least the {stages} stages of --pp-schedule "
                         f"{args.pp_schedule} and divide a data rank's {tokens} tokens (--tokens-per-rank x "
                         "--pp-size: the same global batch): change --microbatches or --tokens-per-rank")
    return {"pp": args.pp_size, "pp_schedule": args.pp_schedule, "microbatches": args.microbatches,
            "pp_overlap": args.pp_overlap, "bucket_mb": math.inf}


def _simulate(cluster: Any, model: Any, plan: Any, training: bool) -> dict[str, Any]:
    from moeflow.sim import simulate_step

    began = time.perf_counter()
    try:
        result = simulate_step(cluster, model, plan, training)
    except ValueError as error:
        raise fail("simulate", error) from None
    record = {"cluster": cluster.name, "ranks": cluster.world_size, "model": model.name, "layers": model.layers,
              "training": training, **result.to_dict(), "wall_s": round(time.perf_counter() - began, 3)}
    print(json.dumps(_rounded(record)), flush=True)
    return record


def _scaling(cluster: Any, model: Any, plan: Any, show: bool) -> int:
    from moeflow.progress import progress_bar
    from moeflow.sim.scaling import growth_exponents, scaling_points, scaling_runs

    records = []
    with progress_bar("simulate --scaling", "run", len(scaling_points()), enabled=show) as progress:
        for record in scaling_runs(cluster, model, plan):
            print(json.dumps(record), flush=True)
            records.append(record)
            progress.advance()
    largest = max(records, key=lambda r: (r["ranks"], r["layers"]))
    slopes = growth_exponents(records)
    print(json.dumps({"summary": "sim-speed", "largest_ranks": largest["ranks"], "largest_layers": largest["layers"],
                      "largest_wall_s": largest["wall_s"], "exponent_ranks": round(slopes["ranks"], 3),
                      "exponent_layers": round(slopes["layers"], 3)}))
    return 0


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _words(text: str) -> list[str]:
    return [word.strip() for word in text.split(",") if word.strip()]


def _degree(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--degree takes integers >= 1 separated by commas, got {text!r}") from None


def _unique(plans: list[Any]) -> list[Any]:
    """Each plan once, by its label (a schedule without a degree or algorithm, like the replicated
    one, is simulated once); a plan its schedule's record refuses raises here."""
    from moeflow.sim import plan_label

    seen, out = set(), []
    for plan in plans:
        key = plan_label(plan)
        if key not in seen:
            seen.add(key)
            out.append(plan)
    return out
