"""How the simulator's own run time grows with ranks and layers: the issue's speed figure (a
2,048-rank, 64-layer step in under 10 s) and the growth exponents, from log-log slopes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.workload import ModelSpec
from moeflow.sim.step import plan_label, simulate_step

SCALING_NODES = (4, 16, 64, 256)
SCALING_LAYERS = (8, 16, 32, 64)


def scaling_points(nodes: tuple[int, ...] = SCALING_NODES,
                   layers: tuple[int, ...] = SCALING_LAYERS) -> list[tuple[int, int]]:
    """The (nodes, layers) timed, on the two axes through the largest point: the ranks axis at the
    most layers, the layers axis at the most nodes."""
    return [(n, max(layers)) for n in nodes] + [(max(nodes), n) for n in layers if n != max(layers)]


def scaling_runs(cluster: Cluster, model: ModelSpec, plan: StepPlan, nodes: tuple[int, ...] = SCALING_NODES,
                 layers: tuple[int, ...] = SCALING_LAYERS) -> Iterator[dict[str, Any]]:
    """One record per (nodes, layers) of :func:`scaling_points`."""
    for node_count, layer_count in scaling_points(nodes, layers):
        sized = cluster.resized(node_count)
        deep = model.with_overrides(layers=layer_count)
        began = time.perf_counter()
        result = simulate_step(sized, deep, plan)
        yield {"bench": "sim-speed", "ranks": sized.world_size, "layers": layer_count, "plan": plan_label(plan),
               "operations": result.operations, "step_ms": round(result.step_s * 1e3, 3),
               "wall_s": round(time.perf_counter() - began, 3)}


def growth_exponents(records: list[dict[str, Any]]) -> dict[str, float]:
    """Slopes of log(wall) against log(ranks) at the most layers and against log(layers) at the
    most ranks: 1 is linear growth."""
    deepest = max(r["layers"] for r in records)
    widest = max(r["ranks"] for r in records)
    return {"ranks": _slope([(r["ranks"], r["wall_s"]) for r in records if r["layers"] == deepest]),
            "layers": _slope([(r["layers"], r["wall_s"]) for r in records if r["ranks"] == widest])}


def _slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    x, y = np.log([p[0] for p in points]), np.log([max(p[1], 1e-6) for p in points])
    return float(np.polyfit(x, y, 1)[0])
