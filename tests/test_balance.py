"""balance='auto' and the proportional replica split: the water filling, the cost model's choice
among off, shadowing and redundant slots, the simulator's slots, and the settings' errors. (That a
layer switching among the three equals the reference, outputs and gradients, is the equivalence
table's ``balance-auto-*`` cases on 1, 2 and 4 processes.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from moeflow import MoELayer
from moeflow.comm.topology import Topology
from moeflow.config import LayerDims, MoEConfig
from moeflow.parallel.balance import choose_execution
from moeflow.parallel.redundant import SlotSchedule
from moeflow.parallel.schedules import ExpertParallelSchedule
from moeflow.parallel.shadowing import ShadowedSchedule
from moeflow.perf import CostModel
from moeflow.perf.balance import OFF, REDUNDANT, SHADOWING
from moeflow.perf.replicas import replica_shares, slot_split, water_fill
from moeflow.sim import LayerLoad, ModelSpec, StepPlan, plan_label, simulate_step
from moeflow.sim.calibrated import load_cluster
from moeflow.training.config import TrainConfig

from equivalence import PROFILE_CHEAP_SHADOWS, PROFILE_DEAR_PARAMETERS


@pytest.mark.parametrize(("total", "levels", "expected"), [
    (10, [0, 0], [5, 5]),  # equal bins: the even split
    (10, [6, 0], [2, 8]),  # the lighter bin first, up to one level
    (3, [0, 10, 5], [3, 0, 0]),  # not enough to reach the others
    (7, [3, 3, 3], [3, 2, 2]),  # the remainder to the lowest index among equals
    (0, [1, 2], [0, 0]),
])
def test_water_fill_brings_the_bins_to_one_level(total: int, levels: list[int], expected: list[int]) -> None:
    assert water_fill(total, np.array(levels)).tolist() == expected


def test_replicas_take_the_tokens_that_even_out_their_ranks() -> None:
    # slots: rank 0 holds experts 0, 1, 2; rank 1 holds 0, 1, 3 (0 and 1 replicated)
    shares = replica_shares(np.array([14, 1, 3, 2]), [0, 1, 2, 0, 1, 3], [0, 0, 0, 1, 1, 1])
    assert shares.tolist() == [6, 1, 3, 8, 0, 2]  # both ranks compute 10
    even = replica_shares(np.array([10, 4, 4]), [0, 1, 0, 2], [0, 0, 1, 1])
    assert even.tolist() == [5, 4, 5, 4]  # equal ranks: the even split


def test_the_runs_cover_each_senders_tokens_once_in_rank_order() -> None:
    tokens = np.array([[7, 1, 0, 2], [7, 0, 3, 0]])
    starts, lengths = slot_split(tokens, [0, 1, 2, 0, 1, 3], [0, 0, 0, 1, 1, 1])
    for expert, columns in enumerate(([0, 3], [1, 4], [2], [5])):
        assert lengths[:, columns].sum(1).tolist() == tokens[:, expert].tolist()
    assert lengths[:, [0, 3]].tolist() == [[6, 1], [0, 7]]  # rank 0's first 6, then the rest on rank 1
    assert starts[0, 3] == 6


def _choice(profile: Any, load: list[float], world: int) -> Any:
    config = MoEConfig(8, 12, 8, redundant_experts=4, balance="auto")
    return choose_execution(config, ExpertParallelSchedule(), Topology(world, world), CostModel(profile), load)


def test_the_choice_keeps_off_where_moving_weights_costs_more_than_it_saves() -> None:
    chosen = _choice(PROFILE_DEAR_PARAMETERS, [5.0, 30, 1, 1, 9, 1, 1, 0], 2)
    assert chosen.choice.mode == OFF and isinstance(chosen.schedule, ExpertParallelSchedule)
    assert chosen.placement.experts_per_rank() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chosen.choice.latency_s[REDUNDANT] > chosen.choice.latency_s[OFF]
    assert chosen.choice.predicted_gain_s == 0


def test_the_choice_runs_each_technique_where_the_model_prices_it_fastest() -> None:
    slots = _choice(PROFILE_CHEAP_SHADOWS, [90.0, 1, 1, 1, 1, 1, 1, 1], 2)
    assert slots.choice.mode == REDUNDANT and isinstance(slots.schedule, SlotSchedule)
    assert sum(len(experts) for experts in slots.placement.experts_per_rank()) == 12
    shadows = _choice(PROFILE_CHEAP_SHADOWS, [60.0, 30, 0, 0, 0, 0, 0, 0], 2)
    assert shadows.choice.mode == SHADOWING and isinstance(shadows.schedule, ShadowedSchedule)
    assert shadows.schedule.setting == "auto"
    for chosen in (slots, shadows):
        latency = chosen.choice.latency_s
        assert latency[chosen.choice.mode] == min(latency.values()) < latency[OFF]


def test_one_rank_keeps_off() -> None:
    assert _choice(PROFILE_CHEAP_SHADOWS, [90.0, 1, 1, 1, 1, 1, 1, 1], 1).choice.mode == OFF


def _simulated_ms(plan: StepPlan, skew: str) -> float:
    from moeflow.perf.sim.workload import skew_shares

    cluster = load_cluster("fastermoe-johnny")
    world = cluster.world_size
    model = ModelSpec(layers=1, dims=LayerDims(512, 1024, 2 * world, top_k=2, bias=False), capacity_factor=0.0,
                      tokens_per_rank=2048, dtype="fp32")
    load = LayerLoad(np.tile(skew_shares(skew, 2 * world) * 4096, (world, 1)))
    return simulate_step(cluster, model, plan, loads=[load], layer_only=True).step_s * 1e3


def test_the_simulator_prices_redundant_slots_against_the_load() -> None:
    world = load_cluster("fastermoe-johnny").world_size
    slots = StepPlan(ragged_exchange=True, redundant_slots=world)
    off = StepPlan(ragged_exchange=True)
    # skewed: the slots even out the ranks; uniform: only the replicas' gradient all-reduce is added
    assert _simulated_ms(slots, "zipf:1.2") < 0.9 * _simulated_ms(off, "zipf:1.2")
    assert _simulated_ms(slots, "uniform") > _simulated_ms(off, "uniform")
    assert "slots+16" in plan_label(slots)


def test_the_simulator_runs_slots_under_the_smart_pipeline_as_the_layer_does() -> None:
    """``pipeline='auto'`` may pick FasterMoE's smart pipeline for a layer with EPLB's slots (both run
    on the expert schedule: a recorded emulated-cluster run did); the simulator prices that too, as
    it prices the slots under the plain expert schedule: the same exchange, pipelined otherwise."""
    world = load_cluster("fastermoe-johnny").world_size
    smart, expert = (_simulated_ms(StepPlan(schedule=name, redundant_slots=world), "zipf:1.2")
                     for name in ("smart", "expert"))
    assert smart != _simulated_ms(StepPlan(schedule="smart"), "zipf:1.2")
    assert smart == pytest.approx(expert, rel=0.15)


def test_the_simulators_slots_refuse_what_the_layer_refuses() -> None:
    with pytest.raises(ValueError, match="without shadowing"):
        _simulated_ms(StepPlan(redundant_slots=16, shadowed=1), "uniform")
    with pytest.raises(ValueError, match="split evenly"):
        _simulated_ms(StepPlan(redundant_slots=3), "uniform")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"balance": "auto"}, "set redundant_experts > 0"),
    ({"balance": "auto", "redundant_experts": 4, "shadowing": "auto"}, "runs without balance='auto'"),
    ({"balance": "sometimes", "redundant_experts": 4}, "unknown balance"),
    ({"balance": "auto", "redundant_experts": 4}, "pass profile="),
    ({"balance": "auto", "redundant_experts": 4, "topology_gate": 0.5, "profile": PROFILE_CHEAP_SHADOWS},
     "topology_gate"),
])
def test_bad_balance_settings_name_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoELayer(8, 12, 8, parallel="expert", **kwargs)


def test_a_balanced_layer_starts_as_expert_parallelism() -> None:
    layer = MoELayer(8, 12, 8, parallel="expert", redundant_experts=4, balance="auto",
                     profile=PROFILE_CHEAP_SHADOWS)
    assert isinstance(layer.schedule, ExpertParallelSchedule) and layer.num_local_experts == 8


def test_the_trainer_asks_for_a_profile() -> None:
    with pytest.raises(ValueError, match=r"--balance auto .* --profile"):
        TrainConfig(redundant_experts=4, balance="auto", workers=2)
