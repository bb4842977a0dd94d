"""``moeflow bench lina-inference``'s pieces without a cluster: the routers of the random models,
the path-length accuracy, the summary against the goals, and one small point on gloo workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from moeflow.bench.lina_inference import HF_MODELS, LinaPoint, accuracy_by_length, hf_model, summarize
from moeflow.bench.lina_plot import plot_lina_inference
from moeflow.hf import moe_blocks
from moeflow.inference import RoutingProfile
from pool import run_distributed


def _skew(skew: float, colocated: bool = False) -> float:
    model = hf_model(skew, None, colocated)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 2048, (8, 64), generator=torch.Generator().manual_seed(1)), use_cache=False)
    loads = [np.array(block.moe.last_stats.tokens_per_expert) for block in moe_blocks(model)]
    return float(np.mean([load.max() / load.mean() for load in loads]))


@pytest.mark.slow
def test_the_random_models_routers_set_the_skew() -> None:
    assert _skew(*HF_MODELS["uniform"]) < 1.3 < 2.0 < _skew(*HF_MODELS["skewed"])
    assert _skew(*HF_MODELS["colocated"]) > 2.0


def test_accuracy_by_length_counts_forwards_whose_top_experts_the_profile_names() -> None:
    # layer 1 repeats layer 0's expert; the profile knows it, so every path length is right at layer 1
    routes = np.array([[[e, (e + 1) % 4], [e, (e + 1) % 4]] for e in (0, 0, 0, 1, 1, 2)])
    profile = RoutingProfile.from_routes(routes, 4, "f", path_length=2)
    accuracy = accuracy_by_length(profile, [routes, routes[:3]], top_k=2, compare_top=2, lengths=(1, 2))
    assert accuracy == {1: [1.0, 1.0], 2: [1.0, 1.0]}
    flipped = routes.copy()
    flipped[:, 1] = (flipped[:, 1] + 2) % 4  # layer 1 now picks other experts than the profile says
    assert accuracy_by_length(profile, [flipped], 2, 2, lengths=(1,))[1] == [1.0, 0.0]


def _rows(model: str, skew: float, times: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    ideal = times["ideal"]
    return [{"bench": "lina-inference", "model": model, "skew": skew, "schedule": name, "median_ms": median,
             "p95_ms": p95, "median_vs_ideal": median / ideal[0], "p95_vs_ideal": p95 / ideal[1]}
            for name, (median, p95) in times.items()]


def test_the_summary_checks_the_goals(tmp_path: Path) -> None:
    records = _rows("skewed", 2.1, {"static": (200, 260), "lina": (150, 170), "oracle": (148, 160),
                                    "ideal": (140, 160), "unpadded": (170, 190)})
    records += _rows("uniform", 1.1, {"static": (150, 160), "lina": (156, 170), "oracle": (150, 160),
                                      "ideal": (140, 150), "unpadded": (150, 160)})
    summary = summarize(records)
    assert summary["skewed"]["goal_speedup"] and summary["skewed"]["goal_p95_within_ideal"]
    assert summary["skewed"]["static_p95_over_lina"] == pytest.approx(260 / 170)
    assert summary["uniform"]["goal_uniform"] is False and summary["uniform"]["goal_speedup"] is None
    plot_lina_inference(records, str(tmp_path / "fig.png"))
    assert (tmp_path / "fig.png").stat().st_size > 1000


def _point(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    from moeflow.bench.lina_inference import measure_point
    from moeflow.comm import ParallelGroups
    from moeflow.comm.topology import Topology
    from moeflow.perf import AlphaBeta, ClusterProfile

    emitted: list[dict[str, Any]] = []
    point = LinaPoint("uniform", batch=2, context=16, batches=2, profile_batches=2, replica_slots=1)
    cluster = ClusterProfile(nodes=2, ranks_per_node=1, fits={  # the replica budget's cost model prices on it
        "alltoall.linear": AlphaBeta(1e-4, 1e-9), "gemm": AlphaBeta(1e-5, 1e-11)})
    measure_point(vars(point), ParallelGroups(dist.group.WORLD, Topology(world_size, 1)), cluster, 1, emitted.append)
    return emitted


@pytest.mark.distributed
def test_a_small_point_measures_every_schedule_on_two_workers() -> None:
    emitted = run_distributed(_point, 2, timeout_s=300)
    assert emitted[1] == []  # rank 0 reports
    records = emitted[0]
    times = [r for r in records if r["bench"] == "lina-inference"]
    assert [r["schedule"] for r in times] == ["static", "lina", "oracle", "ideal", "unpadded"]
    assert all(r["median_ms"] > 0 and r["p95_ms"] >= r["median_ms"] for r in times)
    (estimate,) = [r for r in records if r["bench"] == "lina-inference-estimate"]
    assert len(estimate["accuracy_per_layer"]) == 8
    assert estimate["phase2_rate"] == pytest.approx(1 - estimate["accuracy"])
    # the budget of one copy per worker: its own 4 experts and at most one more, weights moved reported
    assert estimate["own_experts_per_worker"] == 4 and estimate["max_experts_per_worker"] <= 5
    assert estimate["fetched_mb_per_forward"] >= 0 and estimate["replica_slots"] == 1 and estimate["cost_model"]
    moved = estimate["moved_mb_per_forward"]  # phase 2 moves its copies and the dropped early ones
    assert moved >= estimate["fetched_mb_per_forward"] and moved >= estimate["late_mb_per_forward"]
    expert_mb = 3 * 256 * 1024 * 4 / 2**20  # the Mixtral-like expert: three 256 x 1024 fp32 projections
    assert estimate["max_expert_mb_per_worker"] == pytest.approx(estimate["max_experts_per_worker"] * expert_mb)
    assert [r["path_length"] for r in records if r["bench"] == "lina-inference-path-length"] == [1, 2, 3, 4, 5, 6]


def test_the_trained_model_needs_a_checkpoint() -> None:
    from moeflow.cli import main

    with pytest.raises(SystemExit, match="needs --checkpoint RUN_DIR"):
        main(["bench", "lina-inference", "--models", "trained", "skewed"])
