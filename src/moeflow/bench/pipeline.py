"""``moeflow bench pipeline``: fixed (degree, all-to-all) settings vs the planner, on an emulated
cluster, in the spirit of PipeMoE Table IV scaled to this machine.

The driver launches one emulated cluster (2 nodes x 2 ranks by default) and runs this module as
every rank. Unless a profile is given, the ranks first calibrate the cluster (``moeflow
calibrate``'s micro-benchmarks) so that the ``model`` and ``auto`` policies have their profile.
For each configuration of the grid (tokens per rank, model dim, hidden dim, experts per rank, k),
every setting gets its own layer with the same weights and tokens: d in {1, 2, 4, 8} x each
all-to-all algorithm, ``pipeline="model"`` and ``pipeline="auto"`` (run until its dictionary has
settled first, so its online trials are not timed). One iteration is forward + backward; the
settings are timed round-robin, and the slowest rank's time of the pipelined region (dispatch ->
experts -> combine, forward + backward) is kept, median over repeats. The ideal is FasterMoE's
max(t_comp, t_comm) from the expert forward+backward alone and the four all-to-alls alone (the
fastest algorithm), measured in the same run on all ranks at once.

Rank 0 prints one JSON object per measurement; the summary gives, per policy, the share of
configurations within 5% of the best fixed setting, the worst ratio to it, the mean gain over
d=1 (linear) and the mean ratio to the ideal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from moeflow.comm.collectives import barrier
from moeflow.parallel.online_planner import SETTLED
from moeflow.progress import Progress

DEGREES = (1, 2, 4, 8)
WITHIN = 1.05


@dataclass(frozen=True)
class GridPoint:
    tokens: int
    model_dim: int
    hidden_dim: int
    experts_per_rank: int
    top_k: int

    @property
    def name(self) -> str:
        return f"T{self.tokens}-M{self.model_dim}-H{self.hidden_dim}-El{self.experts_per_rank}-k{self.top_k}"


def _iteration(layer: Any, x: Any) -> tuple[float, float]:
    """One forward+backward; (region seconds, whole-layer seconds) on this rank."""
    start = time.perf_counter()
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    layer.zero_grad(set_to_none=True)
    return layer.last_stats.timing.total_s, time.perf_counter() - start


def _ideal(point: GridPoint, world: int, groups: Any, repeats: int) -> dict[str, float]:
    """t_comp: expert forward+backward alone on the dispatched rows; t_comm: the four all-to-alls
    of one iteration alone (fastest algorithm); all ranks at once, slowest rank, medians."""
    import torch

    from moeflow.comm.algorithms import distinct_algorithms, exchange
    from moeflow.config import LayerDims
    from moeflow.core.experts import ExpertFFN
    from moeflow.perf.shape import RegionShape
    from moeflow.timing.measure import slowest_rank_seconds

    num_experts = point.experts_per_rank * world
    dims = LayerDims(point.model_dim, point.hidden_dim, num_experts, point.top_k)
    capacity = RegionShape.for_tokens(dims, point.tokens).capacity
    ffn = ExpertFFN(point.experts_per_rank, point.model_dim, point.hidden_dim)
    rows = torch.randn(point.experts_per_rank, world * capacity, point.model_dim, requires_grad=True)
    buffer = torch.randn(num_experts, capacity, point.model_dim)

    def compute() -> None:
        ffn(rows).square().mean().backward()

    def communicate(algorithm: str) -> None:
        for _ in range(4):
            exchange(algorithm, buffer, groups)

    algorithms = distinct_algorithms(groups.topology)
    operations = {"compute": compute, **{a: (lambda a=a: communicate(a)) for a in algorithms}}
    samples: dict[str, list[float]] = {name: [] for name in operations}
    for round_index in range(repeats + 1):
        for name, operation in operations.items():
            seconds = slowest_rank_seconds(operation)
            if round_index:
                samples[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    t_comp = medians.pop("compute")
    t_comm = min(medians.values())
    return {"t_comp_s": t_comp, "t_comm_s": t_comm, "ideal_s": max(t_comp, t_comm)}


def _measure_point(point: GridPoint, profile: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.timing import SpeedProbe
    from moeflow.comm.algorithms import distinct_algorithms
    from moeflow.comm.groups import ParallelGroups, max_over_ranks
    from moeflow.comm.topology import topology_from_environment
    from moeflow.moe.layer import MoELayer

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = ParallelGroups(dist.group.WORLD, topology_from_environment(os.environ, world))
    num_experts = point.experts_per_rank * world

    def build(**settings: Any) -> MoELayer:
        torch.manual_seed(0)
        return MoELayer(point.model_dim, point.hidden_dim, num_experts, top_k=point.top_k, group=groups, **settings)

    layers: dict[str, MoELayer] = {}
    for algorithm in distinct_algorithms(groups.topology):
        for degree in DEGREES:
            layers[f"d{degree}-{algorithm}"] = build(pipeline=degree, alltoall=algorithm)
    layers["model"] = build(pipeline="model", profile=profile)
    layers["auto"] = build(pipeline="auto", profile=profile)
    x = torch.randn(point.tokens, point.model_dim, generator=torch.Generator().manual_seed(rank))

    settle_iterations = 0
    while True:  # let auto finish its online trials; they are the planner's cost, reported apart
        settle_iterations += 1
        _iteration(layers["auto"], x)
        if layers["auto"].last_stats.plan.source == SETTLED:
            break
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in layers}
    plans: dict[str, Any] = {}
    probe = SpeedProbe()
    for round_index in range(repeats + 1):  # round 0 warms every setting up
        for name, layer in layers.items():
            barrier()
            region, whole = _iteration(layer, x)
            if round_index:
                region, whole = max_over_ranks([region, whole], dist.group.WORLD)
                samples[name].append((region, whole))
            plans[name] = layer.last_stats.plan
        probe.sample()
    ideal = _ideal(point, world, groups, repeats)
    if rank != 0:
        return
    for name, values in samples.items():
        plan = plans[name]
        emit({
            "bench": "pipeline", "config": point.name, **asdict(point), "setting": name,
            "degree": plan.pipeline_degree, "alltoall": plan.alltoall, "source": plan.source,
            "region_ms": statistics.median(v[0] for v in values) * 1e3,
            "layer_ms": statistics.median(v[1] for v in values) * 1e3,
            "predicted_ms": _predicted_ms(plan),
            **({"settle_iterations": settle_iterations} if name == "auto" else {}),
        })
    emit(probe.record("pipeline", point.name))
    emit({"bench": "pipeline-ideal", "config": point.name, **asdict(point),
          **{key.removesuffix("_s") + "_ms": value * 1e3 for key, value in ideal.items()}})


def _predicted_ms(plan: Any) -> float | None:
    forward, backward = plan.predicted_forward_s, plan.predicted_backward_s
    return None if forward is None else (forward + (backward or 0.0)) * 1e3


def _rank_main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench import POINT_DONE, cluster_profile
    from moeflow.distributed import destroy_process_groups
    from moeflow.runtime import tune_cpu_allocator, tuning_requested

    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", required=True, help="JSON list of grid points")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--save-profile", default=None)
    args = parser.parse_args(argv)
    tune_cpu_allocator(tuning_requested(os.environ))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)

    profile = cluster_profile(args.profile, args.save_profile, "pipeline", emit)
    for values in json.loads(args.grid):
        _measure_point(GridPoint(**values), profile, args.repeats, emit)
        if dist.get_rank() == 0:
            print(POINT_DONE, flush=True)  # the command's bar advances a point
    destroy_process_groups()


def run(
    grid: list[GridPoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29750, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid, return rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.pipeline", "pipeline", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile,
                          master_port, timeout_s, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: share within 5% of the best fixed setting, worst ratio to it, mean gain over
    d=1 linear (1 - t / t_d1), mean ratio to the ideal max(t_comp, t_comm)."""
    by_config: dict[str, dict[str, float]] = {}
    ideal: dict[str, float] = {}
    for record in records:
        if record.get("bench") == "pipeline":
            by_config.setdefault(record["config"], {})[record["setting"]] = record["region_ms"]
        elif record.get("bench") == "pipeline-ideal":
            ideal[record["config"]] = record["ideal_ms"]
    policies = ["auto", "model", "d1-linear", "best-d1"]
    table: dict[str, dict[str, list[float]]] = {p: {"ratio_best": [], "gain": [], "ratio_ideal": []} for p in policies}
    for config, times in by_config.items():
        fixed = {name: t for name, t in times.items() if name.startswith("d")}
        best_fixed = min(fixed.values())
        baseline = times["d1-linear"]
        chosen = {
            "auto": times["auto"], "model": times["model"], "d1-linear": baseline,
            "best-d1": min(t for name, t in fixed.items() if name.startswith("d1-")),
        }
        for policy, value in chosen.items():
            table[policy]["ratio_best"].append(value / best_fixed)
            table[policy]["gain"].append(1.0 - value / baseline)
            if config in ideal:
                table[policy]["ratio_ideal"].append(value / ideal[config])
    summary: dict[str, Any] = {"summary": "pipeline", "configs": len(by_config)}
    for policy, columns in table.items():
        ratios = columns["ratio_best"]
        if not ratios:
            continue
        summary[policy] = {
            "share_within_5pct_of_best_fixed": sum(r <= WITHIN for r in ratios) / len(ratios),
            "worst_ratio_to_best_fixed": max(ratios),
            "mean_gain_over_d1_linear": statistics.fmean(columns["gain"]),
            "mean_ratio_to_ideal": statistics.fmean(columns["ratio_ideal"]) if columns["ratio_ideal"] else None,
        }
    best_counts: dict[str, int] = {}
    for times in by_config.values():
        fixed = {name: t for name, t in times.items() if name.startswith("d")}
        winner = min(fixed, key=fixed.get)
        best_counts[winner] = best_counts.get(winner, 0) + 1
    summary["best_fixed_setting_counts"] = best_counts
    summary["targets"] = {"auto_share_within_5pct": 0.9, "auto_worst_ratio": 1.1, "auto_mean_gain": 0.15,
                          "auto_mean_ratio_to_ideal": 1.25}
    return summary


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
