"""``moeflow plan``: predicted times of an MoE layer from a calibrated profile, per all-to-all
algorithm and pipeline degree, the replicated schedule, every Tutel r of the adaptive schedule, and a
summary; with ``--mp N``, Parm's modes behind tensor-parallel attention of N ranks instead (the
DeepSpeed-MoE baseline, S1, S2 with and without SAA, and Algorithm 1's choice). With ``--cluster``,
``--config`` or ``--out``, the joint planner instead (:mod:`moeflow.commands.plan_joint`)."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, add_renamed_flag, fail, positive_int
from moeflow.config import WIRE_DTYPES


def add_parser(commands: Any) -> None:
    plan = commands.add_parser(
        "plan", help="predict an MoE layer's plans from a calibrated profile (--profile), or rank whole training "
        "steps' plans on the simulator (--cluster)",
    )
    plan.add_argument("--profile", default=None, help="a profile written by moeflow calibrate: one layer's plans")
    plan.add_argument("--cluster", default=None,
                      help="the joint planner instead: a simulator cluster (shipped name, TOML, or calibrate JSON); "
                      "ranks layout x schedule x degree x algorithm x shadowing x gradient sync for a whole training "
                      "step on the simulator")
    plan.add_argument("--model", default=None, help="the joint planner for this simulator model (a shipped name or a "
                      "TOML model file), on --cluster or on --profile's twin")
    plan.add_argument("--config", default=None,
                      help="the joint planner for this moeflow train config file's model (with --cluster, or with "
                      "--profile: the calibrated cluster's twin)")
    plan.add_argument("--out", default=None,
                      help="the joint planner writes its fastest plan here as a plan file for moeflow train --plan "
                      "(with --profile: on the calibrated cluster's twin, for moeflow train's model or --config's)")
    plan.add_argument("--nodes", type=positive_int, default=None,
                      help="with --cluster: resize the cluster to this many nodes")
    plan.add_argument("--ep-size", type=positive_int, default=None,
                      help="joint planner: only this expert-parallel group size (default: every size that tiles "
                      "the nodes)")
    plan.add_argument("--pp-size", type=positive_int, default=None,
                      help="joint planner: only this pipeline size (stages over pp-size groups of consecutive "
                      "ranks, as moeflow train --pp-size; 1: no pipeline). Default: 1 and every size whose stages "
                      "tile the nodes and fit the layers, each at the 1f1b, interleaved and dualpipev schedules "
                      "and 1, 2 or 4 times their stage count of micro-batches")
    plan.add_argument("--top", type=positive_int, default=5, help="joint planner: plans to print (default 5)")
    plan.add_argument("--prioritize-alltoall", action="store_true",
                      help="joint planner: all-to-alls take the links before the gradient all-reduce (Lina)")
    plan.add_argument("--tokens", type=positive_int, default=4096, help="tokens per rank (default 4096)")
    plan.add_argument("--model-dim", type=positive_int, default=512, help="model dimension M (default 512)")
    plan.add_argument("--hidden-dim", type=positive_int, default=1024, help="expert hidden size H (default 1024)")
    plan.add_argument("--num-experts", type=positive_int, default=8, help="number of experts E (default 8)")
    add_renamed_flag(plan, "--experts", "--num-experts", type=positive_int)
    plan.add_argument("--top-k", type=positive_int, default=2, help="experts per token k (default 2)")
    plan.add_argument("--capacity-factor", type=float, default=1.0,
                      help="Tutel's capacity factor f; f <= 0 assumes the balanced load (default 1.0)")
    plan.add_argument("--max-degree", type=positive_int, default=16,
                      help="largest pipeline degree to predict (default 16)")
    plan.add_argument("--forward-only", action="store_true", help="plan for inference (no backward pass)")
    plan.add_argument("--mp", type=positive_int, default=1,
                      help="> 1: Parm's modes behind tensor-parallel attention of this many ranks (default 1)")
    plan.add_argument("--esp", type=positive_int, default=None,
                      help="with --mp: hidden shards per expert, N_ESP, for S1 and S2 (default: the --mp size)")
    plan.add_argument("--wire-dtype", default=None, choices=WIRE_DTYPES,
                      help="joint planner: price the exchange in this wire format (default: --config's wire_dtype, "
                      "else exact)")
    plan.add_argument("--skew", default=None,
                      help="uniform, zipf:<s> or one-hot: FasterMoE's shadowing decision (Algorithm 1) and EPLB's "
                      "redundant slots (one extra per rank) for routing with this skew, hottest expert first")
    add_progress_flag(plan)  # the joint planner's search; one layer's plans print at once
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.profile is None) == (args.cluster is None):
        raise fail("plan", "pass --profile (one layer, calibrated fits) or --cluster with --model (the joint planner)")
    from moeflow.commands.plan_joint import joint_plan, wants_joint_plan

    if wants_joint_plan(args):
        return joint_plan(args)
    return _layer_plan(args)


def _layer_plan(args: argparse.Namespace) -> int:
    from moeflow.config import LayerDims
    from moeflow.files import print_json
    from moeflow.perf import ClusterProfile, CostModel
    from moeflow.perf.pipeline import predict_plan, rank_plans
    from moeflow.perf.shape import RegionShape

    try:
        profile = ClusterProfile.load(args.profile)
    except (FileNotFoundError, ValueError) as error:
        raise fail("plan", error) from None
    model = CostModel(profile)
    world = model.world_size
    if args.skew is not None:
        _skew_shares(args)  # a bad --skew fails before any plan is printed
    if args.top_k > args.num_experts or (args.num_experts % world and world % args.num_experts):
        raise fail("plan", f"need top_k <= experts, and experts divisible by the {world} ranks or dividing them")
    if "gemm" not in profile.fits:
        raise fail("plan", "the profile has no gemm fit; re-run moeflow calibrate")
    dims = LayerDims(args.model_dim, args.hidden_dim, args.num_experts, args.top_k)
    region = RegionShape.for_tokens(dims, args.tokens, args.capacity_factor, model.world_size)
    algorithms = [a for a in _algorithms() if f"alltoall.{a}" in profile.fits] if model.world_size > 1 else ["linear"]
    backward = not args.forward_only
    if args.mp > 1:
        from moeflow.perf.parm import shard_count

        esp = shard_count(args.mp, args.esp)
        if world % args.mp or world % esp or args.num_experts % (world // esp) or args.hidden_dim % esp:
            raise fail("plan", f"--mp {args.mp} and --esp {esp} must divide the {world} ranks, --esp the hidden "
                       "size, and leave expert-parallel groups that divide the experts")
        _print_parm_plans(model, region, args.mp, esp, args.max_degree, backward)
        return 0
    _print_adaptive_plans(model, region, algorithms, args.max_degree, backward)
    if args.num_experts % world:  # more ranks than experts: only Tutel's sharded layout fits
        return 0
    _print_expert_parallel_plans(model, region, algorithms, args.max_degree, backward)
    if args.skew is not None:
        _print_skew_plans(model, args)
    best = rank_plans(model, region, range(1, args.max_degree + 1), algorithms, backward)[0]
    replicated = _print_replicated_plan(model, region, backward)
    unpipelined = predict_plan(model, region, 1, best.algorithm, backward)
    print_json({
        "summary": "plan", "alltoall": best.algorithm, "degree": best.degree,
        "schedule": "replicated" if replicated is not None and replicated.total_s < best.total_s else "expert",
        "expert_memory_mb": best.expert_memory_bytes / 2**20,
        "predicted_ms": best.total_s * 1e3, "predicted_d1_ms": unpipelined.total_s * 1e3,
        "world_size": model.world_size, "capacity": region.capacity, "backward": backward,
        "profile_device": profile.device.to_dict(),  # where the fits were measured (calibrate --device)
    })
    return 0


def _algorithms() -> tuple[str, ...]:
    from moeflow.config import ALLTOALL_ALGORITHMS

    return ALLTOALL_ALGORITHMS


def _print_expert_parallel_plans(model: Any, region: Any, algorithms: list[str], max_degree: int,
                                 backward: bool) -> None:
    """One line per (algorithm, degree), and FasterMoE's smart schedule (pipelined over the
    pairwise steps) where the pairwise all-to-all is calibrated."""
    from moeflow.files import print_json
    from moeflow.perf.pipeline import predict_plan, usable_degrees
    from moeflow.perf.schedule_models import SMART_PLAN_ALGORITHM, predict_smart

    if model.world_size > 1 and SMART_PLAN_ALGORITHM in algorithms:
        p = predict_smart(model, region, backward)
        print_json({"plan": "smart", "alltoall": SMART_PLAN_ALGORITHM, "steps": model.profile.nodes,
                    "forward_ms": p.forward_s * 1e3, "backward_ms": p.backward_s * 1e3, "total_ms": p.total_s * 1e3})

    for algorithm in algorithms:
        for degree in usable_degrees(range(1, max_degree + 1), region.capacity):
            p = predict_plan(model, region, degree, algorithm, backward)
            print_json({"plan": "pipeline", "alltoall": algorithm, "degree": degree, "forward_ms": p.forward_s * 1e3,
                        "backward_ms": p.backward_s * 1e3, "total_ms": p.total_s * 1e3})


def _skew_shares(args: argparse.Namespace) -> Any:
    from moeflow.perf.sim.workload import skew_shares

    try:
        return skew_shares(args.skew, args.num_experts)
    except ValueError as error:
        raise fail("plan", f"--skew: {error}") from None


def _print_skew_plans(model: Any, args: argparse.Namespace) -> None:
    """What the layer would do each step at this skew (every rank routing alike): the experts
    Algorithm 1 shadows with the latency it predicts (Eq. 7 without, Eq. 8 with), and the max/mean
    rank load of EPLB's slots beside expert parallelism's."""
    import numpy as np

    from moeflow.comm.topology import Topology
    from moeflow.config import ffn_projections
    from moeflow.files import print_json
    from moeflow.parallel.placement import ExpertPlacement
    from moeflow.parallel.redundant import balanced_placement, rank_loads
    from moeflow.perf.shadowing import ShadowPrices, select_shadowed_experts, shadowed_latency

    world = model.world_size
    load = _skew_shares(args) * args.tokens * args.top_k
    counts = np.tile(load, (world, 1))
    expert_parallel = ExpertPlacement.expert_parallel(args.num_experts, world, args.hidden_dim)
    owners = [expert_parallel.holders(e)[0] for e in range(args.num_experts)]
    prices = ShadowPrices.from_cost_model(model, args.model_dim, args.hidden_dim, ffn_projections("gelu"))
    decision = select_shadowed_experts(counts, owners, prices)
    slots = balanced_placement((load * world).tolist(), args.num_experts // world + 1, Topology(world, model.profile
                               .ranks_per_node), args.hidden_dim)
    plain = rank_loads(expert_parallel, load.tolist())
    redundant = rank_loads(slots, load.tolist())
    print_json({
        "plan": "skew", "skew": args.skew, "tokens_per_expert": (load * world).round().tolist(),
        "shadowed": list(decision.experts), "latency_ms": shadowed_latency(counts, owners, set(), prices) * 1e3,
        "shadowed_latency_ms": shadowed_latency(counts, owners, set(decision.experts), prices) * 1e3,
        "predicted_gain_ms": decision.predicted_gain_s * 1e3,
        "max_over_mean_load": max(plain) / np.mean(plain),
        "redundant_max_over_mean_load": max(redundant) / np.mean(redundant),
        "redundant_slots": slots.experts_per_rank(),
    })


def _print_adaptive_plans(model: Any, region: Any, algorithms: list[str], max_degree: int, backward: bool) -> None:
    """Per Tutel r, the best (degree, algorithm) of the adaptive schedule and its prediction (Tutel
    §3.1, Table 4; :class:`moeflow.perf.schedule_models.AdaptiveModel`)."""
    from moeflow.files import print_json
    from moeflow.perf.schedule_models import AdaptiveModel, rank_schedule_plans

    if not AdaptiveModel().can_predict(model):
        return
    ranked = rank_schedule_plans(model, region, (AdaptiveModel(),), range(1, max_degree + 1), algorithms, backward)
    best: dict[int, Any] = {}
    for plan, prediction in ranked:  # fastest first
        best.setdefault(plan.r, (plan, prediction))
    for r, (plan, p) in sorted(best.items()):
        print_json({"plan": "adaptive", "r": r, "alltoall": plan.algorithm, "degree": plan.degree,
                    "forward_ms": p.forward_s * 1e3, "backward_ms": p.backward_s * 1e3, "total_ms": p.total_s * 1e3,
                    "expert_memory_mb": p.expert_memory_bytes / 2**20})
    plan, p = ranked[0]
    print_json({"summary": "plan-adaptive", "r": plan.r, "alltoall": plan.algorithm, "degree": plan.degree,
                "predicted_ms": p.total_s * 1e3, "world_size": model.world_size, "capacity": region.capacity})


def _print_replicated_plan(model: Any, region: Any, backward: bool) -> Any:
    """The replicated schedule's line (with the gradient all-reduce it adds to training), or None
    when the profile cannot price it."""
    from moeflow.files import print_json
    from moeflow.perf.schedule_models import ReplicatedModel

    schedule = ReplicatedModel()
    if not schedule.can_predict(model):
        return None
    (plan,) = schedule.candidates(region, (), ())
    p = schedule.predict(plan, model, region, backward)
    print_json({"plan": "replicated", "forward_ms": p.forward_s * 1e3, "backward_ms": p.backward_s * 1e3,
                "gradient_sync_ms": p.gradient_sync_s * 1e3, "total_ms": p.total_s * 1e3,
                "expert_memory_mb": p.expert_memory_bytes / 2**20})
    return p


def _print_parm_plans(model: Any, region: Any, mp: int, esp: int, max_degree: int, backward: bool) -> None:
    """Per Parm mode (baseline, S1, S2, S2 + SAA) its best degree and prediction, then the choice
    of ``parallel='auto'`` behind an mp_group (:class:`moeflow.perf.parm.ParmModel`) and the
    unpipelined forward of S1 and S2 that Parm's Algorithm 1 compares."""
    from moeflow.files import print_json
    from moeflow.perf.parm import BaselineModel, ParmModel
    from moeflow.perf.schedule_models import rank_schedule_plans

    parm = ParmModel("parm", mp, esp_size=esp)
    models = (*((BaselineModel(mp_size=mp),) if esp == mp else ()), ParmModel("s1", mp, esp_size=esp),
              ParmModel("s2", mp, esp_size=esp))
    if not all(m.can_predict(model) for m in models):
        return
    combines = [a for a in ("linear", "saa") if f"alltoall.{a}" in model.profile.fits]  # what the layer plans
    degrees = range(1, max_degree + 1)
    ranked = rank_schedule_plans(model, region, models, degrees, combines, backward)
    best: dict[tuple[str, str], Any] = {}
    for plan, prediction in ranked:  # fastest first
        best.setdefault((plan.schedule, plan.algorithm), (plan, prediction))
    for (schedule, combine), (plan, p) in best.items():
        print_json({"plan": "parm", "schedule": schedule, "alltoall": combine, "degree": plan.degree,
                    "forward_ms": p.forward_s * 1e3, "backward_ms": p.backward_s * 1e3, "total_ms": p.total_s * 1e3})
    algorithm1 = parm.closed_form(model, region)  # auto's schedule; its degree and combine from the recurrence
    auto_plan, auto = rank_schedule_plans(model, region, (parm,), degrees, combines, backward)[0]
    print_json({"summary": "plan-parm", "schedule": auto_plan.schedule, "alltoall": auto_plan.algorithm,
                "degree": auto_plan.degree, "predicted_ms": auto.total_s * 1e3,
                "algorithm1": algorithm1.schedule, "algorithm1_s1_ms": algorithm1.t_d1 * 1e3,
                "algorithm1_s2_ms": algorithm1.t_d2 * 1e3, "mp": mp, "esp": esp, "world_size": model.world_size,
                "capacity": region.capacity})
