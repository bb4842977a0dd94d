"""``moeflow bench simulator``: the simulator against measurement on the emulated cluster.

Per (layout, bandwidth): the ranks calibrate (the profile is kept), ``bench pipeline`` measures the
MoE layer's forward+backward at every fixed (degree, all-to-all) setting, and the calibrated
profile's simulated twin predicts the same settings (the MoE layer alone, fp32, as measured). One
JSON line per setting with both times and the error, and per layout the plan the simulator would
pick and its regret: the measured time of that plan over the measured best.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moeflow.bench.pipeline import GridPoint

FIXED_SETTING = re.compile(r"d(\d+)-(\w+)")
LAYOUTS = ((2, 1), (2, 2))
BANDWIDTHS = (0.5, 1.0, 2.0)
GRID = (GridPoint(2048, 512, 256, 2, 2), GridPoint(2048, 512, 1024, 2, 2))


def simulated_ms(profile_path: Path, point: GridPoint, degree: int, algorithm: str) -> float:
    """The twin's forward+backward of one MoE layer at this setting, in ms."""
    from moeflow.sim import ModelSpec, StepPlan, load_cluster, simulate_step

    cluster = load_cluster(profile_path)
    model = ModelSpec(name=point.name, layers=1, model_dim=point.model_dim, hidden_dim=point.hidden_dim,
                      experts=point.experts_per_rank * cluster.world_size, top_k=point.top_k,
                      capacity_factor=1.0, tokens_per_rank=point.tokens, dtype="fp32")
    return simulate_step(cluster, model, StepPlan(degree=degree, algorithm=algorithm), layer_only=True).step_s * 1e3


def compare(measured: list[dict[str, Any]], profile_path: Path, layout: str, gbit: float) -> list[dict[str, Any]]:
    """One record per measured fixed setting, with the simulated time beside it."""
    out = []
    for record in measured:
        match = FIXED_SETTING.fullmatch(str(record.get("setting", "")))
        if record.get("bench") != "pipeline" or match is None:
            continue
        point = GridPoint(**{k: record[k] for k in asdict(GRID[0])})
        simulated = simulated_ms(profile_path, point, int(match[1]), match[2])
        out.append({"bench": "sim-validation", "layout": layout, "inter_gbit": gbit, "config": record["config"],
                    "setting": record["setting"], "measured_ms": round(record["layer_ms"], 3),
                    "simulated_ms": round(simulated, 3), "error": round(simulated / record["layer_ms"] - 1, 4)})
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and max |error|, and the regret of the simulator's pick per (layout, bandwidth, config)."""
    errors = [abs(r["error"]) for r in records]
    regrets = []
    for key in {(r["layout"], r["inter_gbit"], r["config"]) for r in records}:
        group = [r for r in records if (r["layout"], r["inter_gbit"], r["config"]) == key]
        picked = min(group, key=lambda r: r["simulated_ms"])
        regrets.append(picked["measured_ms"] / min(r["measured_ms"] for r in group) - 1)
    return {"summary": "sim-validation", "points": len(records),
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors, default=None),
            "median_regret": statistics.median(regrets) if regrets else None, "max_regret": max(regrets, default=None)}


def run(layouts: tuple[tuple[int, int], ...], bandwidths: tuple[float, ...], grid: list[GridPoint], repeats: int,
        folder: Path, emit: Any) -> list[dict[str, Any]]:
    """Measure and simulate every (layout, bandwidth); the profiles are kept in ``folder``."""
    from moeflow.bench import run_on_cluster

    records: list[dict[str, Any]] = []
    for (nodes, per_node), gbit in ((layout, gbit) for layout in layouts for gbit in bandwidths):
        profile = folder / f"profile-{nodes}x{per_node}-{gbit:g}gbit.json"
        measured = run_on_cluster("moeflow.bench.pipeline", "pipeline", grid, nodes, per_node, gbit, repeats,
                                  None, 29760, 3600, save_profile=str(profile))
        for record in compare(measured, profile, f"{nodes}x{per_node}", gbit):
            emit(record)
            records.append(record)
    return records
