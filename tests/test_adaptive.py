"""Tutel's switchable parallelism (the ``adaptive`` schedule): switching r between iterations moves
no weight, so a training run that changes r on every step equals one at a fixed r; the full state
round-trips through the sharded layout; bad r and layouts get clear errors; the cost model prices
every r. (Layer-vs-reference equivalence of every r is in ``equivalence.adaptive_cases``.)"""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.config import LayerDims, check_switchable_layout, switchable_rs
from moeflow.parallel.online_planner import OnlinePlanner, ternary_next_r
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.schedule_models import LOCAL, AdaptiveModel, Plan
from moeflow.perf.shape import RegionShape
from moeflow.reference import ReferenceMoE
from pool import run_distributed


def _train(rank: int, world: int, num_experts: int, rs: list[int], steps: int) -> list[torch.Tensor]:
    """SGD steps of one layer with r = rs[step % len(rs)]; returns each step's output and the final
    full state, on this rank."""
    torch.manual_seed(3)
    reference = ReferenceMoE(8, 16, num_experts, top_k=1, capacity_factor=0.0)
    layer = MoELayer(8, 16, num_experts, top_k=1, capacity_factor=0.0, parallel="adaptive", alltoall="linear")
    layer.load_full_state_dict(reference.state_dict())
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.005)
    outputs = []
    for step in range(steps):
        x = torch.randn(10, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        y = layer(x, r=rs[step % len(rs)])
        (y.sin().sum() + layer.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(y.detach())
    return [*outputs, *layer.full_state_dict().values()]


def _switching_equals_fixed(rank: int, world: int) -> list[str]:
    failures = []
    for num_experts in (1, 2, 8):
        rs = list(switchable_rs(num_experts, world))
        fixed = _train(rank, world, num_experts, [rs[-1]], steps=5)
        switched = _train(rank, world, num_experts, rs[::-1] + rs, steps=5)
        for index, (a, b) in enumerate(zip(fixed, switched, strict=True)):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                failures.append(f"E={num_experts} rs={rs}: tensor {index} differs by {float((a - b).abs().max())}")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_switching_r_every_step_trains_like_a_fixed_r(world_size: int) -> None:
    results = run_distributed(_switching_equals_fixed, world_size, timeout_s=240, collective_timeout_s=60)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures)


def _full_state_round_trip(rank: int, world: int) -> bool:
    torch.manual_seed(5)
    reference = ReferenceMoE(8, 16, 2, top_k=1)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("b2"):
                param.normal_()
    layer = MoELayer(8, 16, 2, top_k=1, parallel=0)
    layer.load_full_state_dict(reference.state_dict())
    assert layer.experts.w1.shape == (1, 8, 16 // (world // 2))  # hidden slice of one expert
    full = layer.full_state_dict()
    return all(torch.equal(full[name], tensor) for name, tensor in reference.state_dict().items())


@pytest.mark.distributed
def test_sharded_layout_round_trips_the_full_state_on_4_ranks() -> None:
    assert all(run_distributed(_full_state_round_trip, 4, timeout_s=120))


def test_switchable_rs_follow_tutel() -> None:
    assert switchable_rs(8, 4) == (0, 1)
    assert switchable_rs(2, 8) == (0, 1, 2, 4)
    assert switchable_rs(1, 6) == (0, 1, 2, 3, 6)


def test_bad_r_and_layouts_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"not a valid r .* choose one of 0, 1"):
        MoELayer(8, 16, 4, parallel=2)
    with pytest.raises(ValueError, match=r"parallel must be one of .* Tutel's r"):
        MoELayer(8, 16, 4, parallel=-1)
    with pytest.raises(ValueError, match="not a multiple of it"):
        check_switchable_layout(3, 4, 16)
    with pytest.raises(ValueError, match="hidden_dim=10 cannot be split over W / E = 4"):
        check_switchable_layout(1, 4, 10)
    with pytest.raises(ValueError, match=r"needs MoELayer.*parallel='adaptive'"):
        MoELayer(8, 16, 4, parallel="expert")(torch.randn(3, 8), r=1)
    with pytest.raises(ValueError, match="not a valid r"):
        MoELayer(8, 16, 4, parallel="adaptive")(torch.randn(3, 8), r=3)


def _cost() -> CostModel:
    fits = {
        "gemm": AlphaBeta(1e-5, 1e-10), "alltoall.linear": AlphaBeta(1e-4, 1e-8),
        "allgather": AlphaBeta(1e-4, 1e-8), "reducescatter": AlphaBeta(1e-4, 1e-8),
    }
    return CostModel(ClusterProfile(nodes=2, ranks_per_node=4, fits=fits))


def test_cost_of_r_trades_alltoall_volume_for_weight_gathers() -> None:
    """Table 4: r = 0 costs O(P) whatever the capacity; r >= 1 sends r copies of the tokens and
    gathers H / r of each expert over g = S / r ranks; at large capacity r = 0 wins, at small r = S."""
    model, cost = AdaptiveModel(), _cost()

    def seconds(r: int, capacity: int) -> float:
        shape = RegionShape(LayerDims(256, 1024, 2), 8, capacity)
        plan = Plan("adaptive", 1, LOCAL if r == 0 else "linear", r)
        return model.predict(plan, cost, shape, backward=True).total_s

    assert [p.r for p in model.candidates(RegionShape(LayerDims(256, 1024, 2), 8, 64), (1, 2), ("linear",))] == [
        0, 1, 1, 2, 2, 4, 4,
    ]
    small, large = 8, 16384
    assert min((0, 1, 2, 4), key=lambda r: seconds(r, small)) == 4
    assert min((0, 1, 2, 4), key=lambda r: seconds(r, large)) == 0
    assert seconds(0, small) == pytest.approx(seconds(0, 2 * small), rel=0.05)  # O(P): no token traffic


def test_planner_searches_r_with_the_degree_and_keeps_the_fastest() -> None:
    planner = OnlinePlanner("search", ("linear",), None, lambda values: list(values), schedule=AdaptiveModel())
    shape = RegionShape(LayerDims(8, 16, 2), 4, 64)
    seen = set()
    for _ in range(60):
        choice, timing = planner.choose(shape, backward=True)
        seen.add(choice.plan.r)
        timing.forward_s = 1.0 if choice.plan.r == 2 and choice.plan.degree == 2 else 2.0
    assert seen == {0, 1, 2}
    assert planner.dictionary[0] == Plan("adaptive", 2, "linear", 2)


def test_ternary_search_over_r_finds_the_minimum_of_a_convex_cost() -> None:
    interior = (1, 2, 3, 4, 6, 8, 12, 16, 24)
    for best in interior:
        measured: dict[int, float] = {}
        while (r := ternary_next_r(interior, measured)) is not None:
            measured[r] = abs(interior.index(r) - interior.index(best)) + 1.0
        assert min(measured, key=measured.get) == best
        assert len(measured) < len(interior)  # it prunes


def test_planner_runs_tutels_ternary_search_over_r_when_s_has_many_divisors() -> None:
    """W = 12, E = 1: S = 12, r in {0, 1, 2, 3, 4, 6, 12}; the time is convex in r with its minimum
    at r = 3: the search times r = 0, r = 12 and only part of the interior, and keeps r = 3."""
    planner = OnlinePlanner("search", ("linear",), None, lambda values: list(values), schedule=AdaptiveModel())
    shape = RegionShape(LayerDims(8, 48, 1, top_k=1), 12, 64)
    seen = set()
    for _ in range(400):
        choice, timing = planner.choose(shape, backward=True)
        if choice.source == "settled":
            break
        seen.add(choice.plan.r)  # milliseconds: the search's budget of trial time does not bind
        timing.forward_s = 1e-3 * {0: 9.0, 12: 9.0}.get(choice.plan.r, abs(choice.plan.r - 3) + 1.0)
    assert planner.dictionary[0].r == 3
    assert {0, 3, 12} <= seen and seen < {0, 1, 2, 3, 4, 6, 12}
