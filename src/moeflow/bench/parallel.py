"""``moeflow bench parallel``: every fixed Tutel r against the planner's per-iteration choice, on an
emulated cluster (Tutel Fig. 12 scaled down: capacity factor 1..8, two expert sizes). With ``mp``
> 1, Parm's modes behind tensor-parallel attention instead: the DeepSpeed-MoE baseline, S1, S2,
S2 with SAA, and ``auto`` (the planner's S1/S2 choice, Parm's Algorithm 1 plus online trials).

The driver launches one emulated cluster (2 nodes x 1 rank by default: one rank per core) and runs
this module as every rank; unless a profile is given the ranks calibrate the cluster first. For each
point (E experts, hidden H, capacity factor f) every valid r gets its own layer, ``parallel=r``
(its pipeline degree and all-to-all still planned: ``pipeline="auto"``), and one more layer runs
``parallel="adaptive"``, which plans r as well. All have the same weights and tokens. Each layer
first runs until its planner has settled (its online trials are the planner's cost, not timed);
then one forward + backward per layer, round-robin, slowest rank, medians.

Two times per mode: the whole layer (what the planner is judged on), and the region each mode's
cost function models (the schedule alone on a dispatched buffer: weight gathers, all-to-alls and
experts, forward and backward), next to that cost function's prediction for the same plan.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from moeflow.progress import Progress

WITHIN = 1.10  # the planner's goal: within 10 % of the best fixed r


@dataclass(frozen=True)
class ParallelPoint:
    num_experts: int
    hidden_dim: int
    capacity_factor: float
    tokens: int = 1024
    model_dim: int = 256
    top_k: int = 1
    mp: int = 1  # > 1: Parm's schedules behind tensor-parallel attention of this many ranks

    @property
    def name(self) -> str:
        name = f"E{self.num_experts}-H{self.hidden_dim}-f{self.capacity_factor:g}-T{self.tokens}-M{self.model_dim}"
        return name if self.mp == 1 else f"{name}-MP{self.mp}"


def _region_step(layer: Any, buffer: Any, x: Any) -> None:
    """The modelled region alone: the schedule on a dispatched (E, C, M) buffer, forward + backward,
    with the plan the layer last ran. S1's region is the packed slots its own tokens held plus the MP
    all-gather of the token rows (and its backward, the split's all-gather)."""
    from moeflow.comm.mp import gather_rows, split_rows
    from moeflow.core.stats import PipelineTiming
    from moeflow.parallel.context import layer_context
    from moeflow.perf.schedule_models import Plan

    ran = layer.last_stats.plan
    plan = Plan(ran.schedule, ran.requested_degree, ran.alltoall, ran.r)
    extra = 0.0
    if plan.schedule == "s1":
        mp = layer.groups.model
        buffer = buffer[:, : ran.slots]  # the slots its own tokens held
        rows = x.detach().requires_grad_()
        extra = gather_rows(split_rows(rows, mp), rows.shape[0], mp).square().mean()
    import torch

    filled_WE = torch.full((layer.world_size, buffer.shape[0]), buffer.shape[1])  # every slot holds a token
    capacity = layer.dispatchers.capacity
    ctx = layer_context(layer.experts, layer.placement, layer.groups, layer.config, capacity.local, buffer.dtype,
                        PipelineTiming(), filled_WE, buffer.shape[1], "torch", workspace=layer.workspace)
    out = layer.schedule.run(plan, buffer, ctx).combined_ECM
    (out.square().mean() + extra).backward()
    layer.zero_grad(set_to_none=True)



def _measure_point(point: ParallelPoint, groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.timing import SpeedProbe, layer_training_step, settle_planner
    from moeflow.config import switchable_rs
    from moeflow.moe.layer import MoELayer
    from moeflow.parallel.registry import MODEL_PARALLEL_SCHEDULES
    from moeflow.timing.measure import slowest_rank_seconds

    world, rank = dist.get_world_size(), dist.get_rank()
    if point.mp > 1 and groups.model is None:
        groups.model = dist.new_subgroups(group_size=point.mp)[0]

    def build(parallel: Any, alltoall: str = "auto") -> MoELayer:
        torch.manual_seed(0)
        return MoELayer(
            point.model_dim, point.hidden_dim, point.num_experts, top_k=point.top_k,
            capacity_factor=point.capacity_factor, group=groups, parallel=parallel, pipeline="auto",
            profile=profile, mp_group=groups.model if point.mp > 1 else None, alltoall=alltoall,
        )

    if point.mp > 1:
        layers = {name: build(name) for name in MODEL_PARALLEL_SCHEDULES}
        layers["s2-saa"] = build("s2", alltoall="saa")
        layers["planner"] = build("auto")
    else:
        layers = {f"r{r}": build(r) for r in switchable_rs(point.num_experts, world)}
        layers["planner"] = build("adaptive")
    tokens = torch.Generator().manual_seed(rank // point.mp)  # the same tokens on the members of an MP group
    x = torch.randn(point.tokens, point.model_dim, generator=tokens)
    settle = {name: settle_planner(layer, x) for name, layer in layers.items()}
    capacity = next(iter(layers.values())).last_stats.capacity
    buffer = torch.randn(point.num_experts, capacity, point.model_dim, requires_grad=True)
    whole: dict[str, list[float]] = {name: [] for name in layers}
    region: dict[str, list[float]] = {name: [] for name in layers}
    probe = SpeedProbe()
    for round_index in range(repeats + 1):  # round 0 warms every setting up
        for name, layer in layers.items():
            seconds = slowest_rank_seconds(lambda layer=layer: layer_training_step(layer, x))
            region_seconds = slowest_rank_seconds(lambda layer=layer: _region_step(layer, buffer, x))
            if round_index:
                whole[name].append(seconds)
                region[name].append(region_seconds)
        probe.sample()
    if rank == 0:
        emit(probe.record("parallel", point.name))
        _emit_point(point, layers, whole, region, settle, emit)
        if point.mp > 1:
            baseline = statistics.median(whole["ds-baseline"])
            emit({
                "bench": "parallel-parm", "config": point.name,
                **{f"{name}_over_baseline_speedup": baseline / statistics.median(whole[name])
                   for name in ("s1", "s2", "s2-saa", "planner")},
                "planner_schedule": layers["planner"].last_stats.plan.schedule,
            })


def _emit_point(
    point: ParallelPoint, layers: dict[str, Any], whole: dict[str, list[float]], region: dict[str, list[float]],
    settle: dict[str, int], emit: Any,
) -> None:
    from moeflow.bench import record_fields

    medians = {name: statistics.median(values) for name, values in whole.items()}
    fixed = {name: seconds for name, seconds in medians.items() if name != "planner"}
    best = min(fixed, key=fixed.get)
    for name, layer in layers.items():
        plan = layer.last_stats.plan
        predicted = (plan.predicted_forward_s or 0.0) + (plan.predicted_backward_s or 0.0)
        measured_region = statistics.median(region[name])
        emit({
            "bench": "parallel", "config": point.name, **record_fields(point), "mode": name, "r": plan.r,
            "schedule": plan.schedule,
            "degree": plan.requested_degree, "alltoall": plan.alltoall, "capacity": layer.last_stats.capacity,
            "layer_ms": medians[name] * 1e3, "region_ms": measured_region * 1e3,
            "predicted_region_ms": predicted * 1e3 if predicted else None,
            "model_rel_error": abs(predicted - measured_region) / measured_region if predicted else None,
            "settle_iterations": settle[name],
        })
    emit({
        "bench": "parallel-choice", "config": point.name, "best_fixed": best, "best_fixed_ms": fixed[best] * 1e3,
        "planner_r": layers["planner"].last_stats.plan.r, "planner_ms": medians["planner"] * 1e3,
        "planner_schedule": layers["planner"].last_stats.plan.schedule,
        "planner_over_best": medians["planner"] / fixed[best],
        "planner_within_10pct": medians["planner"] <= WITHIN * fixed[best],
    })


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    grid_rank_main(argv, "parallel", lambda values, *rest: _measure_point(ParallelPoint(**values), *rest))


def run(
    grid: list[ParallelPoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29770, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid, return rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.parallel", "parallel", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How often the planner is within 10 % of the best fixed r, and each mode's model error."""
    parm = [r for r in records if r.get("bench") == "parallel-parm"]
    choices = [r for r in records if r.get("bench") == "parallel-choice"]
    modes = [r for r in records if r.get("bench") == "parallel" and r.get("model_rel_error") is not None]
    if not choices and not parm:
        return {"summary": "parallel", "configs": 0}
    errors: dict[str, list[float]] = {}
    for record in modes:
        key = record["mode"] if record["r"] is None or record["mode"] == "planner" else f"r{record['r']}"
        if record["mode"] == "planner" and record["r"] is None:  # Parm's auto: by the schedule it ran
            key = f"planner:{record['schedule']}"
        errors.setdefault(key, []).append(record["model_rel_error"])
    return {
        "summary": "parallel", "configs": len({r["config"] for r in choices + parm}),
        **{f"{name}_over_baseline_geomean": _geomean([r[f"{name}_over_baseline_speedup"] for r in parm])
           for name in ("s1", "s2", "s2-saa", "planner") if parm},
        **_planner_summary(choices),
        "best_fixed": {r["config"]: r["best_fixed"] for r in choices},
        "model_median_rel_error": {k: statistics.median(v) for k, v in sorted(errors.items())},
        "model_median_rel_error_all": statistics.median(e for v in errors.values() for e in v) if errors else None,
    }


def _planner_summary(choices: list[dict[str, Any]]) -> dict[str, Any]:
    if not choices:
        return {}
    return {
        "planner_within_10pct_share": sum(r["planner_within_10pct"] for r in choices) / len(choices),
        "planner_over_best_median": statistics.median(r["planner_over_best"] for r in choices),
        "planner_over_best_worst": max(r["planner_over_best"] for r in choices),
    }


def _geomean(values: list[float]) -> float:
    import math

    return math.exp(sum(math.log(v) for v in values) / len(values))


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
