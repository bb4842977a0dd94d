"""``moeflow bench plan``: the joint planner's pick against its runners-up, as whole ``moeflow train``
runs on an emulated cluster.

The ranks calibrate the cluster (unless a profile is given); the planner ranks the plans of the
benchmark's model on that profile's twin and writes its top plans as plan files, the first exactly
what ``moeflow plan --profile P --config C --out`` writes. Each plan file then runs as ``moeflow train
--plan`` on the cluster, round-robin over the plans, ``repeats`` times; a run's step time is the
median of its steps after the warm-up (its ``summary.json``), a plan's the median of its runs. One
JSON line per plan (predicted, measured, error) and a summary: the pick's regret against the best
measured of the top plans, and its prediction's error.
"""

from __future__ import annotations

import io
import json
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moeflow.progress import Progress, Quiet

BENCH_MODEL: Mapping[str, Any] = MappingProxyType(dict(
    layers=2, heads=4, model_dim=256, hidden_dim=1024, num_experts=8, top_k=2, batch_size=8, context=128,
    steps=12, eval_interval=1000, eval_windows=8, checkpoint_interval=1000, progress=False,
))
"""The benchmark's model and run: a step of about a second on the 2-core machine's 2x2 cluster."""
RUN_TIMEOUT_S = 900


def plan_files(profile: Path, settings: dict[str, Any], folder: Path, top: int) -> list[tuple[Path, dict[str, Any]]]:
    """The planner's ``top`` plans of ``settings``' model on ``profile``'s twin, as plan files (the
    first is ``moeflow plan --out``'s), each with its ``[plan]`` table; plans ``moeflow train``
    refuses are skipped."""
    from moeflow.sim import load_cluster
    from moeflow.sim.planner import search
    from moeflow.training.config import TrainConfig
    from moeflow.training.plan_file import model_of_config, write_plan

    cluster, model = load_cluster(str(profile)), model_of_config(TrainConfig(**settings))
    results = search(cluster, model, top=top * 2)
    files, index = [], 0
    while results and len(files) < top:
        path = folder / f"plan-{len(files) + 1}.toml"
        try:
            table = write_plan(path, results[index:], cluster, model, settings, str(profile))
        except ValueError:  # moeflow train refuses the rest: run the plans written so far
            break
        files.append((path, table))
        index += next(i for i, r in enumerate(results[index:]) if _label(r) == table["label"]) + 1
        if index >= len(results):
            break
    return files


def _label(result: Any) -> str:
    from moeflow.sim import plan_label

    return plan_label(result.plan)


def calibrate(spec: Any, path: Path, master_port: int) -> Path:
    """A profile of the emulated cluster, made by its ranks."""
    from moeflow.testbed import launch

    sink = io.StringIO()
    code = launch(spec, [sys.executable, "-m", "moeflow", "calibrate", "--out", str(path)],
                  master_port=master_port, timeout_s=RUN_TIMEOUT_S, sink=sink)
    if code:
        raise RuntimeError(f"calibration failed (exit {code}):\n{sink.getvalue()[-4000:]}")
    return path


def train_run(spec: Any, plan: Path, run_dir: Path, master_port: int) -> float:
    """One ``moeflow train --plan`` run on the cluster; its measured step time in milliseconds."""
    from moeflow.testbed import launch

    sink = io.StringIO()
    command = [sys.executable, "-m", "moeflow", "train", "--plan", str(plan), "--run-dir", str(run_dir)]
    code = launch(spec, command, master_port=master_port, timeout_s=RUN_TIMEOUT_S, sink=sink)
    if code:
        raise RuntimeError(f"moeflow train --plan {plan} failed (exit {code}):\n{sink.getvalue()[-4000:]}")
    return float(json.loads((run_dir / "summary.json").read_text())["plan"]["measured_step_ms"])


def _calibrated(spec: Any, folder: Path, master_port: int, progress: Progress) -> Path:
    """:func:`calibrate` into ``folder``, counted on ``progress``."""
    progress.expect(1)
    progress.note("calibration")
    path = calibrate(spec, folder / "profile.json", master_port)
    progress.advance()
    return path


def run(spec: Any, folder: Path, settings: dict[str, Any], top: int, repeats: int, profile: Path | None,
        emit: Any = print, master_port: int = 29700, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Calibrate (unless ``profile``), plan, run every top plan ``repeats`` times round-robin; one
    record per plan, fastest predicted first. ``progress`` counts the calibration and the runs."""
    progress = progress or Quiet()
    profile = profile or _calibrated(spec, folder, master_port, progress)
    plans = plan_files(profile, settings, folder, top)
    progress.expect(len(plans) * repeats)
    times: list[list[float]] = [[] for _ in plans]
    for repeat in range(repeats):
        for index, (path, _) in enumerate(plans):
            progress.note(f"plan {index + 1}/{len(plans)}, run {repeat + 1}/{repeats}")
            run_dir = folder / f"run-{index + 1}-{repeat + 1}"
            times[index].append(train_run(spec, path, run_dir, master_port + 1 + repeat * len(plans) + index))
            progress.advance()
    records = []
    for index, ((path, table), measured) in enumerate(zip(plans, times, strict=True), 1):
        median = statistics.median(measured)
        record = {"bench": "plan", "rank": index, "plan": table["label"], "plan_file": str(path),
                  "predicted_step_ms": table["predicted_step_ms"], "measured_step_ms": round(median, 3),
                  "runs_ms": [round(t, 3) for t in measured],
                  "error_percent": round((table["predicted_step_ms"] - median) / median * 100, 2),
                  "layout": f"{spec.nodes}x{spec.ranks_per_node}", "inter_gbit": spec.inter_gbit}
        emit(json.dumps(record))
        records.append(record)
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The pick (rank 1) against the best measured of the top plans, and the predictions' errors."""
    pick, best = records[0], min(records, key=lambda r: r["measured_step_ms"])
    errors = [abs(r["error_percent"]) for r in records]
    return {"summary": "bench plan", "pick": pick["plan"], "pick_measured_ms": pick["measured_step_ms"],
            "best": best["plan"], "best_measured_ms": best["measured_step_ms"],
            "regret_percent": round((pick["measured_step_ms"] / best["measured_step_ms"] - 1) * 100, 2),
            "pick_error_percent": pick["error_percent"], "median_abs_error_percent": statistics.median(errors),
            "max_abs_error_percent": max(errors), "plans": len(records)}
