"""The schedule choice: ``parallel="auto"`` ranks expert parallelism against replicated experts
for a training step on the profile (all-to-alls vs the gradient all-reduce), and falls back to
expert parallelism without a profile or a token hint."""

from __future__ import annotations

import pytest

from moeflow.config import LayerDims
from moeflow.parallel.registry import select_schedule
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.schedule_models import ExpertParallelModel, Plan, ReplicatedModel
from moeflow.perf.shape import RegionShape


def _cost(alltoall_beta: float, allreduce_beta: float) -> CostModel:
    return CostModel(ClusterProfile(nodes=2, ranks_per_node=1, fits={
        "gemm": AlphaBeta(1e-5, 1e-11), "alltoall.linear": AlphaBeta(1e-4, alltoall_beta),
        "allreduce": AlphaBeta(1e-4, allreduce_beta),
    }))


SMALL_EXPERTS = RegionShape(LayerDims(model_dim=256, hidden_dim=64, num_experts=2), world_size=2, capacity=1024)
LARGE_EXPERTS = RegionShape(LayerDims(model_dim=256, hidden_dim=4096, num_experts=8), world_size=2, capacity=256)


@pytest.mark.parametrize(("shape", "expected"), [(SMALL_EXPERTS, "replicated"), (LARGE_EXPERTS, "expert")])
def test_auto_weighs_the_alltoalls_against_the_gradient_allreduce(shape: RegionShape, expected: str) -> None:
    cost = _cost(8e-9, 8e-9)  # ~1 Gbit/s both
    choice = select_schedule("auto", shape.dims.num_experts, 2, cost, shape, ("linear",))
    assert (choice.schedule.name, choice.reason) == (expected, "model")
    replicated = ReplicatedModel().predict(Plan("replicated", 1, "none"), cost, shape, backward=True)
    expert = ExpertParallelModel().predict(Plan("expert", 1, "linear"), cost, shape, backward=True)
    assert (replicated.total_s < expert.total_s) == (expected == "replicated")
    assert replicated.expert_memory_bytes == 2 * expert.expert_memory_bytes  # E vs E / 2 experts per rank


def test_without_a_profile_or_hint_auto_keeps_expert_parallelism() -> None:
    assert select_schedule("auto", 8, 2, None, None, ("linear",)).reason == "default"
    assert select_schedule("auto", 8, 2, _cost(1e-6, 1e-12), None, ("linear",)).schedule.name == "expert"
    assert select_schedule("replicated", 8, 2, None, None, ("linear",)).reason == "forced"
    # a profile without the all-reduce fit cannot price replicated training: not chosen
    no_allreduce = CostModel(ClusterProfile(nodes=2, ranks_per_node=1, fits={
        "gemm": AlphaBeta(1e-5, 1e-11), "alltoall.linear": AlphaBeta(1.0, 1e-3)}))
    assert select_schedule("auto", 2, 2, no_allreduce, SMALL_EXPERTS, ("linear",)).schedule.name == "expert"
