"""The one registry of parallel techniques: the names, the simulator's modes and the combination
rules all come from its records, and the layer and the trainer refuse a combination with the
same message."""

from __future__ import annotations

from typing import Any

import pytest

from moeflow import MoELayer
from moeflow.config import MoEConfig
from moeflow.data import stdlib_directory
from moeflow.parallel.registry import (
    FEATURES,
    PARALLEL_CHOICES,
    RAGGED_SCHEDULES,
    SCHEDULES,
    SIMULATED,
    ShardingLayout,
    check_techniques,
    expected_schedule,
)
from moeflow.sim import StepPlan, plan_label
from moeflow.training.config import TrainConfig

TINY_RUN: dict[str, Any] = dict(
    data=str(stdlib_directory() / "json"), vocab_size=512, context=32, layers=2, heads=2, model_dim=32,
    hidden_dim=64, num_experts=4, top_k=2, batch_size=4, steps=2, progress=False, alltoall="linear",
)
TURNED_ON: dict[str, dict[str, Any]] = {
    "shadowing": {"shadowing": (0,)},
    "topology_gate": {"topology_gate": 0.1},
    "pipeline='smart'": {"pipeline": "smart"},
    "redundant_experts": {"redundant_experts": 1},
    "expert_kernel='ragged'": {"expert_kernel": "ragged"},
    "alltoall": {"alltoall": "2dh"},
    "alltoall='saa'": {"alltoall": "saa"},
    "esp_size": {"esp_size": 2},
    "token_exchange='ragged'": {"token_exchange": "ragged"},
    "token_exchange='dedup'": {"token_exchange": "dedup"},
    "balance='auto'": {"balance": "auto", "redundant_experts": 4},
    "wire_dtype": {"wire_dtype": "bf16"},
}
"""The settings that turn each config-enabled feature on (a new feature adds its line)."""
RUN_CLASS_NAMES = (*(spec.name for spec in SCHEDULES), "parm", "packed")


def _config(**settings: Any) -> MoEConfig:
    return MoEConfig(model_dim=8, hidden_dim=16, num_experts=4, **settings)


def _turned_on(config: MoEConfig) -> list[str]:
    return [feature.name for feature in FEATURES if feature.enabled is not None and feature.enabled(config)]


def test_every_schedule_runs_is_priced_and_is_simulated_under_its_name() -> None:
    assert ("auto", *(spec.name for spec in SCHEDULES)) == PARALLEL_CHOICES
    for spec in SCHEDULES:
        schedule = spec.make(ShardingLayout(2))
        assert schedule.name == spec.name and schedule.model.name == spec.name
        assert schedule.takes_ragged == spec.takes_ragged  # the record says what its run class does
        assert SIMULATED[spec.name].simulated is spec.simulated
        parallel = 2 if spec.behind_model_parallel else 1
        plan = StepPlan(schedule=spec.name, mp=parallel, esp=parallel, r=1 if spec.takes_r else None)
        assert plan_label(plan).startswith(spec.name)
    assert set(SIMULATED) == {*(spec.name for spec in SCHEDULES), "smart"}
    assert RAGGED_SCHEDULES == ("expert", "replicated")


def test_every_config_feature_says_how_it_is_turned_on() -> None:
    assert {feature.name for feature in FEATURES if feature.enabled is not None} == set(TURNED_ON)
    for name, settings in TURNED_ON.items():
        assert _turned_on(_config(**settings)) == [name]
    assert _turned_on(_config()) == []


@pytest.mark.parametrize("feature", FEATURES, ids=lambda feature: feature.name)
def test_a_feature_runs_on_its_schedules_only(feature: Any) -> None:
    config = _config(**TURNED_ON.get(feature.name, {}))
    applied = () if feature.enabled is not None else (feature.name,)
    for schedule in RUN_CLASS_NAMES:
        if schedule in feature.runs_on:
            check_techniques(config, schedule, applied)
            continue
        with pytest.raises(ValueError, match=f"this layer runs parallel='{schedule}': use parallel=") as error:
            check_techniques(config, schedule, applied)
        assert str(error.value).startswith(feature.name) and feature.off in str(error.value)


def test_exclusions_hold_whichever_side_declares_them() -> None:
    pairs = [(feature, other) for feature in FEATURES for other in feature.excludes]
    assert len(pairs) >= 10
    for feature, excluded in pairs:
        for first, second in ((feature.name, excluded), (excluded, feature.name)):
            settings = {**TURNED_ON.get(first, {}), **TURNED_ON.get(second, {})}
            applied = tuple(name for name in (first, second) if name not in TURNED_ON)
            with pytest.raises(ValueError, match=r"runs without .* turn off"):
                check_techniques(_config(**settings), "expert", applied)


def test_the_layer_and_the_trainer_refuse_a_combination_with_the_same_message() -> None:
    with pytest.raises(ValueError) as layer_error:
        MoELayer(8, 16, 4, parallel="replicated", topology_gate=0.14)
    with pytest.raises(ValueError) as trainer_error:
        TrainConfig(**TINY_RUN, workers=2, parallel="replicated", topology_gate=0.14)  # before any worker starts
    assert str(layer_error.value) == str(trainer_error.value)
    assert "use parallel='expert' or topology_gate='off'" in str(layer_error.value)


def test_an_unknown_schedule_is_refused_by_the_layer_and_the_trainer() -> None:
    message = r"parallel must be one of auto, expert, replicated, adaptive, s1, s2, ds-baseline or Tutel's r"
    with pytest.raises(ValueError, match=message):
        MoELayer(8, 16, 4, parallel="experts")
    with pytest.raises(ValueError, match=message):
        TrainConfig(**TINY_RUN, parallel="experts")


@pytest.mark.parametrize(("parallel", "experts", "world", "mp", "expected"), [
    ("auto", 4, 2, 1, "expert"), ("auto", 2, 4, 1, "adaptive"), ("auto", 4, 4, 2, "parm"), (1, 4, 8, 1, "adaptive"),
    ("replicated", 4, 2, 1, "replicated"),
])
def test_a_launcher_predicts_the_schedule_the_layer_builds(
    parallel: str | int, experts: int, world: int, mp: int, expected: str
) -> None:
    assert expected_schedule(parallel, experts, world, mp) == expected
