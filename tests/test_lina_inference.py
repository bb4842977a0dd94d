"""Lina's inference scheduling: the packer, the estimator, the profile file and the scheduled layer
(which must compute exactly what the static placement computes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.core.routing.selection import ExpertChoice
from moeflow.inference import (
    InferenceScheduler,
    RoutingProfile,
    SchedulerSettings,
    first_fit_decreasing,
    popularity_assignment,
    popularity_placement,
    schedule_layers,
)
from moeflow.inference.assignment import assignment_loads
from moeflow.inference.scheduler import balanced_choice, top_experts
from moeflow.parallel.redundant import rank_loads
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from pool import run_distributed

from equivalence import FP32_TOLERANCE

# -- first-fit decreasing and the placement ---------------------------------------------------------


def test_first_fit_decreasing_fills_the_first_bin_that_fits_largest_first() -> None:
    items = [(0, 0.6), (1, 0.5), (2, 0.4), (3, 0.3), (4, 0.2)]
    assert first_fit_decreasing(items, 3, 1.0, 4) == [[0, 2], [1, 3, 4]]


def test_first_fit_decreasing_respects_the_item_limit_and_overflows_onto_the_lightest_bin() -> None:
    assert first_fit_decreasing([(i, 0.1) for i in range(5)], 3, 1.0, 2) == [[0, 1], [2, 3], [4]]
    assert first_fit_decreasing([(0, 0.7), (1, 0.6), (2, 0.1)], 2, 1.0, 4) == [[0, 2], [1]]
    assert first_fit_decreasing([(0, 0.7), (1, 0.6)], 1, 1.0, 4) == [[0, 1]]


def test_an_even_load_keeps_expert_parallelism() -> None:
    assert popularity_assignment([1] * 8, 2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert popularity_assignment([3] * 16, 4, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_a_popular_expert_gets_ranks_in_proportion_and_the_rest_are_packed() -> None:
    # shares 2.5, .5, .5, .5: expert 0 rounds to 3 ranks, but the rest need 2 bins (1.5 ranks of load)
    assert popularity_assignment([5, 1, 1, 1], 4, 4) == [[0], [0], [1, 2], [3]]
    # share 2.25: two ranks; 7 x .25 packed four to a rank
    plan = popularity_assignment([9, 1, 1, 1, 1, 1, 1, 1], 4, 4)
    assert plan == [[0], [0], [1, 2, 3, 4], [5, 6, 7]]
    assert rank_loads(popularity_placement([9, 1, 1, 1, 1, 1, 1, 1], 4, 6), [9, 1, 1, 1, 1, 1, 1, 1]) == [
        4.5, 4.5, 4.0, 3.0]


def test_unloaded_experts_fill_the_ranks_with_the_fewest_experts() -> None:
    assert popularity_assignment([10, 0, 0, 0], 4, 4) == [[0, 1], [0, 2], [0, 3], [0]]
    # every token to expert 3: with at most 4 experts per rank no slot is left for a second copy
    assert popularity_assignment([0, 0, 0, 16, 0, 0, 0, 0], 2, 4) == [[1, 3, 4, 6], [0, 2, 5, 7]]
    assert popularity_assignment([0, 0, 0, 16, 0, 0, 0, 0], 2, 5) == [[0, 2, 3, 5, 7], [1, 3, 4, 6]]
    assert popularity_assignment([0] * 8, 2, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_a_skewed_load_is_balanced_over_two_ranks() -> None:
    load = [30, 20, 10, 5, 5, 3, 2, 1]
    plan = popularity_assignment(load, 2, 4)
    assert sorted(e for rank in plan for e in rank) == list(range(8))
    assert max(rank_loads(popularity_placement(load, 2, 6), load)) == 39  # static: 65 on rank 0


def test_the_placement_checks_its_expert_limit() -> None:
    with pytest.raises(ValueError, match="max_experts_per_rank=2 cannot hold 8 experts on 2 ranks; use at least 4"):
        popularity_assignment([1] * 8, 2, 2)
    assert popularity_assignment([1] * 8, 1, 2) == [list(range(8))]


# -- the estimator and the profile file ---------------------------------------------------------------


def _routes() -> np.ndarray:
    """(tokens, 2 layers, k=1): 10 tokens 0 -> 2, 6 tokens 1 -> 3."""
    return np.array([[[0], [2]]] * 10 + [[[1], [3]]] * 6)


def test_the_estimate_follows_each_tokens_path() -> None:
    profile = RoutingProfile.from_routes(_routes(), 4, "f", path_length=1)
    assert profile.estimate(1, np.array([[0], [0], [1]]), top_k=1).tolist() == [0, 0, 2, 1]
    # layer 0 has no path: every token gets the layer's popularity, cut to its top-1
    np.testing.assert_allclose(profile.estimate(0, np.zeros((4, 0), dtype=np.int64), top_k=1), [2.5, 0, 0, 0])


def test_a_rare_or_unseen_path_falls_back_to_the_layers_popularity() -> None:
    profile = RoutingProfile.from_routes(_routes(), 4, "f", path_length=1)
    # expert 2 was never first at layer 0; with min_tokens=7 the 6 tokens of path [1] are too few
    np.testing.assert_allclose(profile.estimate(1, np.array([[2]]), top_k=1), [0, 0, 10 / 16, 0])
    np.testing.assert_allclose(profile.estimate(1, np.array([[1]]), top_k=1, min_tokens=7), [0, 0, 10 / 16, 0])
    np.testing.assert_allclose(profile.estimate(1, np.array([[1]]), top_k=2, min_tokens=7), [0, 0, 10 / 16, 6 / 16])


def test_longer_paths_tell_apart_what_one_layer_cannot() -> None:
    # layer 2 follows layer 0: paths (0, 1) -> 2 and (3, 1) -> 3; layer 1 alone (always 1) says 50/50
    routes = np.array([[[0], [1], [2]]] * 8 + [[[3], [1], [3]]] * 8)
    short, long = (RoutingProfile.from_routes(routes, 4, "f", path_length=n) for n in (1, 2))
    history = np.array([[0, 1]] * 4)
    np.testing.assert_allclose(short.estimate(2, history, top_k=2), [0, 0, 2, 2])
    np.testing.assert_allclose(long.estimate(2, history, top_k=2), [0, 0, 4, 0])


def test_the_profile_file_round_trips_and_refuses_another_model(tmp_path: Path) -> None:
    routes = np.random.default_rng(0).integers(0, 8, size=(300, 3, 2))
    profile = RoutingProfile.from_routes(routes, 8, "abc", path_length=2)
    profile.save(tmp_path / "p.safetensors")
    loaded = RoutingProfile.load(tmp_path / "p.safetensors")
    history = routes[:50, :2, 0]
    np.testing.assert_array_equal(loaded.estimate(2, history, 2), profile.estimate(2, history, 2))
    assert (loaded.tokens, loaded.num_layers, loaded.top_k) == (300, 3, 2)
    loaded.check_matches(3, 8, "abc", "p")
    with pytest.raises(ValueError, match=r"another model \(MoE layers 3 vs the model's 4; router fingerprint"):
        loaded.check_matches(4, 8, "xyz", "p")
    with pytest.raises(FileNotFoundError, match="moeflow profile-routing"):
        RoutingProfile.load(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a profile")
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error for a file that is not one
        RoutingProfile.load(tmp_path / "bad.safetensors")


def test_top_experts_and_the_ideal_gate() -> None:
    assert top_experts(np.array([1, 5, 5, 0]), 2) == {1, 2}
    choice = ExpertChoice(torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2), torch.ones(5, 2), torch.ones(5, 4))
    balanced = balanced_choice(choice, 4, rank=1).expert_idx_TK
    assert balanced[:, 0].tolist() == [2, 0, 2, 0, 2] and torch.bincount(balanced.reshape(-1)).tolist() == [2, 2, 3, 3]


def test_settings_name_the_fix() -> None:
    with pytest.raises(ValueError, match="static needs no scheduler"):
        SchedulerSettings(schedule="static")
    with pytest.raises(ValueError, match="path_length must be an integer >= 1"):
        SchedulerSettings(path_length=0)
    with pytest.raises(ValueError, match="pass profile="):
        InferenceScheduler(SchedulerSettings("lina"), 2)
    with pytest.raises(ValueError, match="replica_slots must be an integer >= 0"):
        SchedulerSettings("oracle", replica_slots=-1)
    with pytest.raises(ValueError, match="6 experts must split evenly over the 4 workers"):
        InferenceScheduler(SchedulerSettings("oracle", replica_slots=1), 2).check_layer(6, 4)


# -- the scheduled layer equals the static one ---------------------------------------------------------

E, M, H = 8, 6, 10


def _layers(groups: ParallelGroups | None, capacity_factor: float, hidden_dim: int = H) -> list[MoELayer]:
    torch.manual_seed(0)
    layers = [MoELayer(M, hidden_dim, E, top_k=2, capacity_factor=capacity_factor, group=groups, parallel="expert")
              for _ in range(3)]
    torch.manual_seed(1)
    for layer in layers:
        full = {name: torch.randn_like(t) * 0.5 for name, t in layer.full_state_dict().items()}
        layer.load_full_state_dict(full)
    return layers


def _inputs(kind: str, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    if kind == "one-expert":  # every token the same: all pick the same two experts, six pick none
        return torch.ones(12, M)
    x = torch.randn(9 + 3 * rank, M, generator=generator)  # uneven token counts, an empty rank 3
    return x[:0] if rank == 3 else x + (1.5 if kind == "skewed" else 0.0)


def _forward(layers: list[MoELayer], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = x + layer(x)
    return x


def _scheduled(rank: int, world_size: int, schedule: str, kind: str, capacity_factor: float,
               routes: np.ndarray | None, replica_slots: int | None = None,
               cluster: ClusterProfile | None = None, hidden_dim: int = H) -> dict[str, Any]:
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, 1)) if world_size > 1 else None
    layers = _layers(groups, capacity_factor, hidden_dim)
    x = _inputs(kind, rank)
    with torch.no_grad():
        static = _forward(layers, x)
        profile = None if routes is None else RoutingProfile.from_routes(routes, E, "f", path_length=2)
        settings = SchedulerSettings(schedule, max_experts_per_rank=4, replica_slots=replica_slots)
        scheduler = InferenceScheduler(settings, 3, profile, cost=None if cluster is None else CostModel(cluster))
        schedule_layers(layers, scheduler)
        stored = [layer.num_local_experts for layer in layers]
        scheduled = [_forward(layers, x) for _ in range(2)]
        records = scheduler.take_records()
        stats = layers[-1].last_stats
        schedule_layers(layers, None)
        back = _forward(layers, x)
    return {"static": static.numpy(), "scheduled": [y.numpy() for y in scheduled], "back": back.numpy(),
            "records": [r.to_dict() for r in records], "stored": stored,
            "dropped": sum(stats.dropped_per_expert), "schedule": stats.plan.schedule,
            "rank_tokens": stats.rank_tokens}


def _profile_routes(kind: str) -> np.ndarray:
    """Every token's choices at the 3 layers, recorded by an oracle scheduler on one process."""
    layers = _layers(None, 0.0)
    scheduler = InferenceScheduler(SchedulerSettings("oracle"), 3, keep_routes=True)
    schedule_layers(layers, scheduler)
    with torch.no_grad():
        for rank in range(4):
            _forward(layers, _inputs(kind, rank) if rank < 3 else _inputs(kind, 0) * 0.5)
    return np.concatenate(scheduler.routes)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(("schedule", "kind", "capacity_factor", "profiled_on"), [
    ("lina", "skewed", 0.0, "skewed"),  # estimates from the same kind of tokens
    ("lina", "even", 1.0, "skewed"),  # estimates from other tokens (phase 2) and drops
    ("lina", "one-expert", 0.0, "skewed"),
    ("oracle", "skewed", 1.25, None),
    ("unpadded", "skewed", 0.0, None),  # the static placement through the unequal-split exchange
])
def test_the_scheduled_layers_compute_what_the_static_placement_computes(
    world_size: int, schedule: str, kind: str, capacity_factor: float, profiled_on: str | None
) -> None:
    routes = None if profiled_on is None else _profile_routes(profiled_on)
    results = run_distributed(_scheduled, world_size, schedule, kind, capacity_factor, routes, timeout_s=120)
    for result in results:
        for scheduled in result["scheduled"]:
            # the equivalence table's fp32 tolerance: the per-expert GEMMs on gathered rows sum in another
            # order than the static placement's padded ones (on AVX-512/AMX CPUs 2e-6 apart)
            np.testing.assert_allclose(scheduled, result["static"], **FP32_TOLERANCE)
        np.testing.assert_array_equal(result["back"], result["static"])
        assert result["schedule"] == "dynamic"
        assert result["stored"] == [E // world_size] * 3  # each rank stores its own experts only
        assert len(result["records"]) == 6 and [r["layer"] for r in result["records"]] == [0, 1, 2] * 2
    records = results[0]["records"]
    assert all(record == other["records"] for other in results for record in [records])  # one plan everywhere
    for record in records:  # the plan spreads its load as the record says
        assert sum(record["rank_tokens"]) == pytest.approx(sum(record["load"]))
        assert sorted({e for rank in record["plan"] for e in rank}) == list(range(E))
    if schedule == "lina":
        assert all(r["phase"] in (1, 2) and r["accurate"] == (r["phase"] == 1) for r in records)
        phases = {r["phase"] for r in records}
        if kind == "skewed":  # profiled on tokens like these: the estimate's top experts are right
            assert phases == {1}
        if kind == "even":  # profiled on other tokens: a layer re-plans from the gate's counts
            assert 2 in phases
    if kind == "one-expert":
        assert sum(1 for load in records[0]["load"] if load == 0) == E - 2
        if world_size > 1:  # the popular experts run on ranks that do not store them: fetched
            local = E // world_size
            assert any(e // local != rank for record in records for rank, plan in enumerate(record["plan"])
                       for e in plan)
    counted = [r for r in records if r["phase"] != 1]  # planned from the gate's counts, not the estimate
    if world_size > 1 and kind == "skewed" and counted and schedule != "unpadded":  # the plan evens the ranks' work
        even = popularity_assignment([1] * E, world_size, 4)
        static = [max(assignment_loads(even, np.array(r["load"]))) for r in counted]
        busiest = [max(r["rank_tokens"]) for r in counted]
        assert all(b <= s for b, s in zip(busiest, static, strict=True)) and busiest != static


def _within_one_slot(results: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The records (one plan on every rank), after checking that the outputs are the static
    placement's, each rank stored its own experts and computed them plus at most one copy."""
    local = E // world_size
    for result in results:
        for scheduled in result["scheduled"]:
            np.testing.assert_allclose(scheduled, result["static"], **FP32_TOLERANCE)
        assert result["stored"] == [local] * 3
    records = results[0]["records"]
    assert all(other["records"] == records for other in results)
    for record in records:
        for rank, plan in enumerate(record["plan"]):
            assert set(range(rank * local, (rank + 1) * local)) <= set(plan) and len(plan) <= local + 1
    return records


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_replica_budget_keeps_each_workers_own_experts_and_at_most_r_copies(world_size: int) -> None:
    """``replica_slots=1``: each worker computes its own E / W experts and at most one copy of
    another, the outputs stay the static placement's, and the records count the copies fetched."""
    results = run_distributed(_scheduled, world_size, "oracle", "skewed", 0.0, None, 1, timeout_s=120)
    local = E // world_size
    records = _within_one_slot(results, world_size)
    for record in records:
        assert record["fetched"] == sum(len(plan) - local for plan in record["plan"])
        assert record["held"] == max(len(plan) for plan in record["plan"]) <= local + 1
    assert any(record["fetched"] for record in records)  # the skewed load earns copies


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(("kind", "capacity_factor"), [("skewed", 0.0), ("even", 1.0)])
def test_lina_places_each_layer_a_layer_ahead_within_the_replica_budget(
    world_size: int, kind: str, capacity_factor: float
) -> None:
    """Lina with ``replica_slots=1``: phase 1 of layer l is planned at layer l - 1 from the path
    estimate and its copies posted there (``early``); a layer whose estimate was wrong re-plans
    from the gate and fetches on the critical path (``late``); layer 0 has no layer before it. The
    outputs stay the static placement's and no rank computes more than its own experts and one copy."""
    routes = _profile_routes("skewed")
    results = run_distributed(_scheduled, world_size, "lina", kind, capacity_factor, routes, 1, timeout_s=120)
    records = _within_one_slot(results, world_size)
    for record in records:
        if record["layer"] == 0:  # nothing runs before layer 0's gate to fetch its copies under
            assert record["early"] == 0 and record["late"] == record["fetched"]
        elif record["phase"] == 1:  # used as posted a layer ahead
            assert record["early"] == record["fetched"] and record["late"] == 0
        else:  # re-placed from the gate's counts: its copies fetched now
            assert record["late"] == record["fetched"]
    later = [r for r in records if r["layer"] > 0]
    if world_size > 1 and kind == "skewed":  # the estimate is right (and on 4 workers its copies came early)
        assert {r["phase"] for r in later} == {1} and any(r["early"] for r in later) == (world_size == 4)
    if world_size > 1 and kind == "even":  # profiled on other tokens: some layer re-plans
        assert any(r["phase"] == 2 for r in records)


def _cluster(link_seconds_per_byte: float, hidden_dim: int) -> ClusterProfile:
    """A cluster whose links cost ``link_seconds_per_byte`` and whose experts 1 ms per token."""
    expert_per_work = 1e-3 / (M * hidden_dim * 2)  # ffn.forward's x is tokens * M * H * projections
    return ClusterProfile(nodes=4, ranks_per_node=1, fits={
        "alltoall.linear": AlphaBeta(0.0, link_seconds_per_byte), "ffn.forward": AlphaBeta(0.0, expert_per_work),
        "gemm": AlphaBeta(0.0, 1e-12)})


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["oracle", "lina"])
def test_a_cost_model_makes_only_the_copies_that_pay(schedule: str) -> None:
    """With a calibrated cost model, copies are made on a fast link and none on a link so slow that
    no balance pays for an expert's weights (the plan stays the static one); outputs unchanged.
    The experts are wide (an expert's weights outweigh the rows a copy keeps off the busiest link:
    with H = 10 a copy would pay on the exchange alone)."""
    routes, hidden = _profile_routes("skewed") if schedule == "lina" else None, 200
    fetched = {}
    for name, seconds_per_byte in (("fast", 1e-12), ("slow", 1.0)):
        results = run_distributed(_scheduled, 4, schedule, "skewed", 0.0, routes, 1,
                                  _cluster(seconds_per_byte, hidden), hidden, timeout_s=120)
        for result in results:
            for scheduled in result["scheduled"]:
                np.testing.assert_allclose(scheduled, result["static"], **FP32_TOLERANCE)
        fetched[name] = sum(r["fetched"] for r in results[0]["records"])
        if name == "slow":
            assert all(plan == list(range(2 * rank, 2 * rank + 2)) for r in results[0]["records"]
                       for rank, plan in enumerate(r["plan"]))
    assert fetched == {"fast": fetched["fast"], "slow": 0} and fetched["fast"] > 0
