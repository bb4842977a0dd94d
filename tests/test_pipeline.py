"""The pipelined dispatch -> experts -> combine: chunking, real overlap, equality with d=1 on 1, 2
and 4 processes (every algorithm), and the PipeMoE model behind the planner."""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.config import LayerDims
from moeflow.core.experts import ExpertFFN
from moeflow.core.stats import PipelineTiming, region_clock
from moeflow.parallel.chunk_pipeline import ExpertExchange, pipelined_experts, run_pipeline
from moeflow.parallel.online_planner import OnlinePlanner
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.pipeline import (
    capacity_chunks,
    pipeline_makespan,
    predict_plan,
    rank_plans,
)
from moeflow.perf.shape import RegionShape
from pool import run_distributed
from theorem1 import theorem1_degree, theorem1_for_shape

# -- chunking and the model ---------------------------------------------------------------------


def test_capacity_chunks_cover_the_capacity_in_near_equal_contiguous_ranges() -> None:
    assert capacity_chunks(12, 8) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9), (9, 10), (10, 11), (11, 12)]
    assert capacity_chunks(3, 8) == [(0, 1), (1, 2), (2, 3)]  # never an empty chunk
    assert capacity_chunks(0, 4) == [(0, 0)]
    assert capacity_chunks(10, 1) == [(0, 10)]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="pipeline degree"):
            capacity_chunks(10, bad)  # type: ignore[arg-type]


def test_makespan_of_the_event_recurrences() -> None:
    assert pipeline_makespan([1.0], [5.0], [1.0]) == 7.0  # r = 1: t_d + t_e + t_c
    # computation-bound: D1, then four experts back to back, then the last combine
    assert pipeline_makespan([1.0] * 4, [3.0] * 4, [1.0] * 4) == pytest.approx(1 + 12 + 1)
    # communication-bound, one network: eight all-to-alls in a row
    assert pipeline_makespan([3.0] * 4, [1.0] * 4, [3.0] * 4) == pytest.approx(24)
    # Eq. 11 as printed lets C1 start while D2..D4 still run (two networks)
    assert pipeline_makespan([3.0] * 4, [1.0] * 4, [3.0] * 4, shared_network=False) == pytest.approx(3 + 1 + 12)


def test_theorem1_closed_form_matches_the_recurrence_exactly() -> None:
    """Cross-check: the degree of Theorem 1 is the recurrence's best degree, and its predicted time
    is the recurrence's time at that degree (one shared network, as the theorem assumes)."""
    rng = random.Random(0)
    for _ in range(500):
        aa, ba, nd = 10 ** rng.uniform(-5, -2), 10 ** rng.uniform(-10, -8), 10 ** rng.uniform(5, 8)
        ae, be, ne = 10 ** rng.uniform(-5, -2), 10 ** rng.uniform(-12, -10), 10 ** rng.uniform(8, 11)

        def recurrence(r: int, aa=aa, ba=ba, nd=nd, ae=ae, be=be, ne=ne) -> float:
            t_a2a, t_e = [aa + ba * nd / r] * r, [ae + be * ne / r] * r
            return pipeline_makespan(t_a2a, t_e, t_a2a)

        choice = theorem1_degree(aa, ba, nd, ae, be, ne, 16)
        best = min(range(1, 17), key=recurrence)
        assert recurrence(choice.degree) == pytest.approx(recurrence(best), rel=1e-12)
        assert choice.predicted_s == pytest.approx(recurrence(choice.degree), rel=1e-12)


def _profile(a2a_alpha: float, a2a_beta: float, interference: float = 1.0) -> ClusterProfile:
    return ClusterProfile(
        nodes=2, ranks_per_node=2, interference=interference,
        fits={
            "gemm": AlphaBeta(2e-5, 1.3e-11),
            "alltoall.linear": AlphaBeta(a2a_alpha, a2a_beta),
            "alltoall.2dh": AlphaBeta(2 * a2a_alpha, a2a_beta),
            "alltoall.pairwise": AlphaBeta(1.5 * a2a_alpha, 1.1 * a2a_beta),
        },
    )


def test_model_pipelines_balanced_layers_and_not_startup_bound_ones() -> None:
    shape = RegionShape(LayerDims(model_dim=512, hidden_dim=1024, num_experts=8), world_size=4, capacity=512)
    balanced = CostModel(_profile(5e-4, 8e-9))
    ranked = rank_plans(balanced, shape, range(1, 17), ("linear", "2dh", "pairwise"))
    assert ranked[0].degree > 1 and ranked[0].algorithm == "linear"
    assert ranked[0].total_s < predict_plan(balanced, shape, 1, "linear").total_s
    assert [p.total_s for p in ranked] == sorted(p.total_s for p in ranked)
    # 50 ms to start any all-to-all: splitting only adds startups
    startup_bound = CostModel(_profile(5e-2, 1e-10))
    assert rank_plans(startup_bound, shape, range(1, 17), ("linear",))[0].degree == 1
    # Theorem 1 agrees with the recurrence on the forward pass (up to uneven chunks: 512 / d)
    for interference in (1.0, 1.4):
        model = CostModel(_profile(5e-4, 8e-9, interference))
        choice = theorem1_for_shape(model, shape, "linear", 16)
        forward = {d: predict_plan(model, shape, d, "linear", backward=False).forward_s for d in range(1, 17)}
        assert choice.predicted_s == pytest.approx(forward[choice.degree], rel=1e-3)
        assert choice.predicted_s <= min(forward.values()) * (1 + 1e-3)


LCM_1_TO_16 = 720720  # every degree up to 16 splits a multiple of it into equal chunks
RECORDED_PROFILE = Path(__file__).parent / "data" / "profile-2x2-1gbit-2026-11-25.json"
"""A 2x2 calibration of the emulated cluster whose FFN and all-to-all fits have start-up costs
(Theorem 1's regimes need them; later recordings fitted some at 0)."""


def _fig6_profile() -> ClusterProfile:
    """PipeMoE's Fig. 6 fits: the GEMM (a) and the 16-GPU all-to-all (b)."""
    return ClusterProfile(nodes=2, ranks_per_node=8, fits={
        "gemm": AlphaBeta(6.19e-5, 4.1e-14), "alltoall.linear": AlphaBeta(1.72e-5, 2.96e-10)})


@pytest.mark.parametrize("profile", ["fig6", "recorded"])
def test_theorem1_on_the_planners_costs_is_the_model_policys_degree(profile: str) -> None:
    """Theorem 1 fed the planner's own costs (the calibrated FFN fits of a recorded profile, not the
    GEMM fit) predicts the recurrence's forward time, and where its assumptions hold (every degree
    splits the capacity evenly) its degree is the one the ``model`` policy picks for a forward."""
    cost = CostModel(_fig6_profile() if profile == "fig6" else ClusterProfile.load(RECORDED_PROFILE))
    if profile == "recorded":
        assert "ffn.forward" in cost.profile.fits  # the planner prices experts with the FFN fit
    world = cost.profile.nodes * cost.profile.ranks_per_node
    picked = set()
    for model_dim, hidden_dim, experts in [(1024, 4096, 16), (8, 16, 16), (4, 8192, 16), (2, 65536, 16)]:
        dims = LayerDims(model_dim=model_dim, hidden_dim=hidden_dim, num_experts=experts)
        shape = RegionShape(dims, world_size=world, capacity=LCM_1_TO_16)
        planner = OnlinePlanner("model", ("linear",), cost, reduce_max=list)
        chosen = planner.choose(shape, backward=False)[0].plan.degree
        theorem = theorem1_for_shape(cost, shape, "linear", 16)
        forward = predict_plan(cost, shape, theorem.degree, "linear", backward=False).forward_s
        assert theorem.predicted_s == pytest.approx(forward, rel=1e-9)
        assert chosen == theorem.degree, (model_dim, hidden_dim, experts)
        picked.add(chosen)
    assert len(picked) > 1  # the shapes span more than one regime


def test_theorem1_restricted_to_the_even_degrees_of_a_capacity() -> None:
    cost = CostModel(ClusterProfile.load(RECORDED_PROFILE))
    shape = RegionShape(LayerDims(model_dim=512, hidden_dim=1024, num_experts=8), world_size=4, capacity=96)
    even = [d for d in range(1, 17) if shape.capacity % d == 0]
    theorem = theorem1_for_shape(cost, shape, "linear", 16, degrees=even)
    assert theorem.degree == rank_plans(cost, shape, even, ("linear",), backward=False)[0].degree


def test_interference_makes_overlapped_compute_slower_in_the_model() -> None:
    shape = RegionShape(LayerDims(model_dim=512, hidden_dim=1024, num_experts=8), world_size=4, capacity=512)
    calm = predict_plan(CostModel(_profile(5e-4, 8e-9)), shape, 4, "linear")
    noisy = predict_plan(CostModel(_profile(5e-4, 8e-9, interference=1.5)), shape, 4, "linear")
    assert noisy.total_s > calm.total_s
    assert predict_plan(CostModel(_profile(5e-4, 8e-9, interference=1.5)), shape, 1, "linear") == predict_plan(
        CostModel(_profile(5e-4, 8e-9)), shape, 1, "linear"
    )


# -- the executor ---------------------------------------------------------------------------------


@dataclass
class _RecordingExchange:
    """A stand-in for ExpertExchange that blocks the experts of chunk 0 until the dispatch of
    chunk 1 has run: only an executor that overlaps them can finish."""

    dispatch_of_chunk1_ran: threading.Event
    threads: set[str]
    groups: ParallelGroups = field(default_factory=ParallelGroups.single_process)
    communicates: bool = True

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        if float(chunk_ECM[0, 0, 0]) == 1.0:
            self.dispatch_of_chunk1_ran.set()
        return chunk_ECM.clone()

    def from_experts(self, y: torch.Tensor, rows: int) -> torch.Tensor:
        return y

    def chunk(self, start: int, stop: int) -> _RecordingExchange:
        return self


def test_dispatch_of_the_next_chunk_runs_while_experts_compute() -> None:
    chunk_exchange = _RecordingExchange(threading.Event(), set())
    buffer = torch.arange(4.0).view(1, 4, 1).expand(1, 4, 1).contiguous()  # chunk i starts with value i

    def compute(index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            ran = chunk_exchange.dispatch_of_chunk1_ran.wait(timeout=10)
            assert ran, "chunk 1 was not dispatched during experts(0)"
        return x * 2

    out = run_pipeline(buffer, capacity_chunks(4, 4), compute, chunk_exchange)  # type: ignore[arg-type]
    torch.testing.assert_close(out, buffer * 2)
    assert chunk_exchange.threads == {name for name in chunk_exchange.threads if name.startswith("moeflow-comm")}


def _all_experts(experts: int, dtype: torch.dtype, activation: str) -> ExpertFFN:
    torch.manual_seed(3)  # the same weights on every rank; each rank keeps its slice
    full = ExpertFFN(experts, 6, 10, activation).to(dtype)
    with torch.no_grad():
        full.b1.normal_()
        full.b2.normal_()
    return full


def _pipeline_vs_degree_one(rank: int, world: int, per_node: int | None) -> list[str]:
    """Every degree and algorithm gives the d=1 outputs and gradients (buffer and weights)."""
    distributed = dist.is_initialized()
    groups = ParallelGroups(dist.group.WORLD, Topology(world, per_node or world)) if distributed else None
    topology = Topology(world, per_node or world)
    algorithms = ("linear", "2dh", "pairwise") if distributed and topology.num_nodes > 1 else ("linear",)
    failures = []
    for dtype, activation, capacity in ((torch.float32, "gelu", 13), (torch.float64, "swiglu", 8)):
        experts = 2 * world
        full = _all_experts(experts, dtype, activation)
        local = ExpertFFN(2, 6, 10, activation).to(dtype)
        local.load_state_dict({k: v[2 * rank : 2 * rank + 2] if v.dim() else v for k, v in full.state_dict().items()})
        buffer = torch.randn(experts, capacity, 6, dtype=dtype, generator=torch.Generator().manual_seed(rank))
        upstream = torch.randn(experts, capacity, 6, dtype=dtype, generator=torch.Generator().manual_seed(9 + rank))
        results = {}
        for algorithm in algorithms:
            for degree in (1, 2, 3, 4, 8):
                chunk_exchange = ExpertExchange(groups, algorithm, 2)
                x = buffer.clone().requires_grad_()
                local.zero_grad()
                y = pipelined_experts(x, local.compute, local.weights(), chunk_exchange, degree)
                (y * upstream).sum().backward()
                results[(algorithm, degree)] = [y.detach(), x.grad] + [p.grad.clone() for p in local.parameters()]
        baseline = results[("linear", 1)]
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
        for key, tensors in results.items():
            for index, (actual, expected) in enumerate(zip(tensors, baseline, strict=True)):
                try:
                    torch.testing.assert_close(actual, expected, **tolerance)
                except AssertionError as error:
                    failures.append(f"rank {rank} {dtype} {key} tensor {index}: {str(error).splitlines()[-1]}")
    return failures


def test_a_planner_trial_on_cuda_waits_for_the_device_at_the_region_bounds_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A synced timing (a planner trial on CUDA) waits for its device when the pipelined region
    starts and ends, forward and backward, and never per chunk (that would undo the overlap it
    measures); an ordinary timing never waits. CUDA's wait is recorded, so this runs on CPU."""
    waited: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    experts = ExpertFFN(2, 6, 10, "gelu")
    x = torch.randn(2, 8, 6, requires_grad=True)
    chunk_exchange = ExpertExchange(None, "linear", 2)
    synced = PipelineTiming(synced_device="cuda:0")
    pipelined_experts(x, experts.compute, experts.weights(), chunk_exchange, 4, synced).sum().backward()
    assert waited == ["cuda:0"] * 4 and synced.forward_s > 0 and synced.backward_s > 0
    plain = PipelineTiming()
    pipelined_experts(x, experts.compute, experts.weights(), chunk_exchange, 4, plain).sum().backward()
    region_clock(None)
    assert len(waited) == 4 and plain.forward_s > 0 and plain.synced_device is None


def test_every_degree_equals_degree_one_in_one_process() -> None:
    assert _pipeline_vs_degree_one(0, 1, None) == []


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "per_node"), [(1, None), (2, 1), (4, 2)])
def test_every_degree_and_algorithm_equals_degree_one(world: int, per_node: int | None) -> None:
    results = run_distributed(_pipeline_vs_degree_one, world, per_node, timeout_s=240, collective_timeout_s=60)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def run_in_launched_rank() -> None:
    """Entry point for ranks started by ``moeflow launch`` (the emulated cluster): the pipeline
    against d=1 and the layer's pipeline cases against the reference; exit 1 on any mismatch."""
    from datetime import timedelta

    from equivalence import check_cases, pipeline_cases

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = _pipeline_vs_degree_one(rank, world, int(os.environ["LOCAL_WORLD_SIZE"]))
    _, layer_failures = check_cases(rank, world, pipeline_cases({"top_k": 2, "capacity_factor": 1.0}))
    dist.destroy_process_group()
    failures += layer_failures
    print("\n".join(failures) or "pipeline equals d=1 and the reference", flush=True)
    raise SystemExit(1 if failures else 0)
