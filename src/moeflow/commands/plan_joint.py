"""``moeflow plan --cluster`` (or ``--profile`` with ``--config`` or ``--out``): the joint planner.
It ranks whole training steps' plans (pipeline, layout, schedule, degree, algorithm, shadowing) on the
simulator and, with ``--out``, writes the fastest plan that ``moeflow train`` accepts as a plan file
that ``moeflow train --plan`` runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moeflow.commands import fail, show_progress


def wants_joint_plan(args: argparse.Namespace) -> bool:
    """The joint planner runs for --cluster, and for --profile with a model, a train config or a plan
    file to write."""
    return any(value is not None for value in (args.cluster, args.out, args.config, args.model, args.ep_size,
                                                args.wire_dtype, args.pp_size))


def joint_plan(args: argparse.Namespace) -> int:
    from moeflow.config import EXACT_WIRE
    from moeflow.progress import progress_bar
    from moeflow.sim import ClusterFileError, load_cluster, plan_label
    from moeflow.sim.planner import SearchSpace, search

    source = args.cluster or args.profile
    if args.out is not None and args.forward_only:
        raise fail("plan", "--out writes a plan moeflow train runs (a training step); drop --forward-only, which "
                   "plans an inference batch")
    try:
        cluster = load_cluster(source)
        cluster = cluster.resized(args.nodes) if args.nodes else cluster
        base, model = _model(args)
        space = SearchSpace(prioritize_alltoall=args.prioritize_alltoall, mp=args.mp,
                            ep_sizes=(args.ep_size,) if args.ep_size else (),
                            wire_dtype=args.wire_dtype or base.get("wire_dtype", EXACT_WIRE),
                            pp_sizes=_pp_sizes(args, base))
        with progress_bar("plan", "sim", enabled=show_progress(args)) as progress:
            results = search(cluster, model, training=not args.forward_only, top=max(args.top, 2), space=space,
                             progress=progress)
    except (ClusterFileError, ValueError, FileNotFoundError) as error:
        raise fail("plan", error) from None
    for rank, result in enumerate(results[:args.top], 1):
        print(json.dumps({"rank": rank, **result.to_dict(), "step_ms": round(result.step_s * 1e3, 4)}), flush=True)
    best = results[0]
    print(f"# {cluster.name} ({cluster.world_size} ranks), {model.name}: best plan {plan_label(best.plan)} at "
          f"{best.step_s * 1e3:.4g} ms per {'batch' if args.forward_only else 'step'}")
    if args.out is not None:
        profile = source if str(source).endswith(".json") else None
        _write(Path(args.out), results, cluster, model, base, profile, not args.forward_only)
    return 0


def _pp_sizes(args: argparse.Namespace, base: dict[str, Any]) -> tuple[int, ...]:
    """The pipeline sizes to search: ``--pp-size``'s, or every one; none above 1 for a plan file
    whose base settings the pipelined trainer refuses (it says so)."""
    from moeflow.training.plan_file import pipeline_blockers

    blockers = pipeline_blockers(base) if args.out is not None else []
    if blockers and (args.pp_size or 1) > 1:
        raise ValueError(f"--pp-size {args.pp_size}: the pipelined trainer does not run {', '.join(blockers)} (the "
                         "config's): change them, or drop --pp-size")
    if blockers:
        print(f"# no pipeline searched: the pipelined trainer does not run {', '.join(blockers)}", flush=True)
        return (1,)
    return (args.pp_size,) if args.pp_size else ()


def _model(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The settings the plan file starts from and the simulator's model: a train config's
    (--config, or moeflow train's defaults when planning a calibrated profile), or a model file's."""
    from moeflow.sim import load_model
    from moeflow.training.config import TrainConfig, load_config_file
    from moeflow.training.plan_file import model_of_config, settings_of_model

    if args.model is not None and args.config is not None:
        raise ValueError("pass --model (a simulator model file) or --config (a moeflow train config), not both")
    if args.config is not None or (args.model is None and args.cluster is None):
        values = load_config_file(args.config) if args.config else {}
        return values, model_of_config(TrainConfig(**values))
    model = load_model(args.model)
    if args.out and not model.vocab_size:  # moeflow train has a vocabulary: price its embedding and LM head
        model = model.with_overrides(vocab_size=TrainConfig().vocab_size)
    return (settings_of_model(model) if args.out else {}), model


def _write(path: Path, results: list[Any], cluster: Any, model: Any, base: dict[str, Any], profile: str | None,
           training: bool) -> None:
    from moeflow.training.plan_file import write_plan

    try:
        table = write_plan(path, results, cluster, model, base, profile, training)
    except ValueError as error:
        raise fail("plan", error) from None
    print(f"# wrote {path}: {table['label']}, predicted {table['predicted_step_ms']:.4g} ms per step; "
          f"run it with moeflow train --plan {path}")
