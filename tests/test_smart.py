"""FasterMoE's smart schedule (§4.2): its plan among the planner's candidates, its model, what a
layer reports when it runs, and its errors. (That it equals the reference, outputs and gradients,
is in the equivalence table: the ``smart-*`` cases on 1, 2 and 4 processes.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.config import LayerDims
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.pipeline import pipeline_makespan, predict_plan
from moeflow.perf.schedule_models import SMART, ExpertParallelModel, Plan, predict_smart
from moeflow.perf.shape import RegionShape
from pool import run_distributed

SHAPE = RegionShape(LayerDims(model_dim=64, hidden_dim=128, num_experts=4), world_size=2, capacity=256)


def _profile(nodes: int = 2, per_node: int = 1) -> ClusterProfile:
    return ClusterProfile(nodes=nodes, ranks_per_node=per_node, fits={
        "alltoall.pairwise": AlphaBeta(1e-3, 1e-8), "alltoall.linear": AlphaBeta(1e-3, 1e-8),
        "gemm": AlphaBeta(1e-5, 1e-10),
    })


def test_the_expert_schedule_offers_the_smart_plan_where_pairwise_is_a_candidate() -> None:
    model = ExpertParallelModel()
    assert Plan(SMART, 1, "pairwise") in model.candidates(SHAPE, [1, 2], ["linear", "pairwise"])
    assert all(plan.schedule == "expert" for plan in model.candidates(SHAPE, [1, 2], ["linear"]))


def test_with_one_rank_per_node_the_first_step_is_free_and_overlaps_the_remote_one() -> None:
    cost = CostModel(_profile())
    smart = predict_smart(cost, SHAPE, backward=False)
    whole = cost.t_alltoall("pairwise", 4 * 256 * 64 * 4)
    step = cost.t_ffn(256, 64, 128, 2) * 2  # two local experts on one source's slots
    assert smart.forward_s == pytest.approx(pipeline_makespan([0.0, whole], [step, step], [0.0, whole]))
    unpipelined = predict_plan(cost, SHAPE, 1, "pairwise", backward=False)
    assert smart.forward_s < unpipelined.forward_s  # C_0 runs while S_1 is in flight
    assert ExpertParallelModel().predict(Plan(SMART, 1, "pairwise"), cost, SHAPE, False) == smart


def _smart_stats(rank: int, world_size: int) -> dict[str, Any]:
    groups = ParallelGroups(torch.distributed.group.WORLD, Topology(world_size, 1))
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, top_k=2, parallel="expert", pipeline="smart", group=groups)
    layer(torch.randn(10, 8)).sum().backward()
    assert layer.last_stats is not None and layer.last_stats.plan is not None
    timing = layer.last_stats.timing
    return {"schedule": layer.last_stats.plan.schedule, "source": layer.last_stats.plan.source,
            "timed": timing.forward_s is not None and timing.backward_s is not None,
            "grads": all(p.grad is not None for p in layer.experts.parameters())}


def test_a_layer_forced_to_smart_reports_it_and_times_both_passes() -> None:
    for result in run_distributed(_smart_stats, 2):
        assert result == {"schedule": SMART, "source": "forced", "timed": True, "grads": True}


def test_smart_needs_the_expert_schedule() -> None:
    with pytest.raises(ValueError, match="pipeline='smart' runs FasterMoE's pairwise steps"):
        MoELayer(8, 16, 4, parallel="replicated", pipeline="smart")
    with pytest.raises(ValueError, match="unknown pipeline 'smarter'; choose one of auto, model, search, smart"):
        MoELayer(8, 16, 4, pipeline="smarter")


def test_parallel_auto_runs_the_expert_schedule_when_a_smart_plan_ranks_first() -> None:
    from moeflow.parallel.registry import select_schedule
    from moeflow.perf.schedule_models import AdaptiveModel, ReplicatedModel, rank_schedule_plans

    profile = ClusterProfile(nodes=2, ranks_per_node=1, fits={
        **_profile().fits, "alltoall.linear": AlphaBeta(1e-3, 1e-7), "allreduce": AlphaBeta(1.0, 1e-6),
    })
    models = (ExpertParallelModel(), ReplicatedModel(), AdaptiveModel())
    ranked = rank_schedule_plans(CostModel(profile), SHAPE, models, (1,), ("linear", "pairwise"), backward=True)
    assert ranked[0][0].schedule == SMART
    choice = select_schedule("auto", 4, 2, CostModel(profile), SHAPE, ("linear", "pairwise"))
    assert (choice.schedule.name, choice.reason) == ("expert", "model")
