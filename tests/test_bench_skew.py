"""``moeflow bench skew``'s pieces that run without a cluster: the pinned routing, the recorded
loads of a training run, the per-rank compute load and the summary against the goals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow import MoELayer
from moeflow.bench.skew import (
    SkewPoint,
    recorded_loads,
    routed_tokens,
    routing_probabilities,
    steer_gate,
    summarize,
)


def test_the_steered_gate_routes_tokens_by_the_drawn_distribution() -> None:
    point = SkewPoint("zipf:1.2", tokens=4000, model_dim=16)
    shares = routing_probabilities(point)
    assert shares.argmax() == 0 and shares.sum() == pytest.approx(1.0)
    layer = MoELayer(16, 8, 4, top_k=1, capacity_factor=0.0)
    steer_gate(layer)
    layer(routed_tokens(point, seed=0))
    assert layer.last_stats is not None
    counts = torch.tensor(layer.last_stats.tokens_per_expert, dtype=torch.float64)
    torch.testing.assert_close(counts / counts.sum(), torch.from_numpy(shares), atol=0.03, rtol=0)
    one_hot = SkewPoint("one-hot", tokens=50, model_dim=16)
    layer(routed_tokens(one_hot, seed=1))
    assert layer.last_stats.tokens_per_expert == [50, 0, 0, 0]


def test_bad_skews_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown skew 'zipfian'"):
        routing_probabilities(SkewPoint("zipfian"))
    with pytest.raises(ValueError, match="need 4 non-negative shares"):
        routing_probabilities(SkewPoint("trace-b0", probabilities=(1.0, 2.0)))


def test_recorded_loads_average_the_last_steps_of_each_block(tmp_path: Path) -> None:
    lines = [{"step": s, "moe": [{"block": 1, "tokens_per_expert": [s, 10 - s]}]} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert recorded_loads(str(tmp_path), 2) == {"trace-b1": (7 / 20, 13 / 20)}  # steps 3 and 4
    (tmp_path / "empty.jsonl").write_text(json.dumps({"step": 1, "moe": []}) + "\n")
    with pytest.raises(ValueError, match="no step records with MoE load"):
        recorded_loads(str(tmp_path / "empty.jsonl"), 2)


def test_the_summary_checks_both_goals() -> None:
    records = [
        {"bench": "skew-compare", "config": "u", "skew": "uniform", "auto_over_off_speedup": 0.98,
         "smart_over_off_speedup": 1.0, "smart_auto_over_off_speedup": 1.0, "redundant_over_off_speedup": 1.0,
         "max_over_mean_load_redundant": 1.0, "balance_mode": "off", "balance_over_off_speedup": 1.0,
         "balance_over_best_speedup": 0.99},
        {"bench": "skew-compare", "config": "z", "skew": "one-hot", "auto_over_off_speedup": 1.5,
         "smart_over_off_speedup": 1.0, "smart_auto_over_off_speedup": 1.4, "redundant_over_off_speedup": 1.6,
         "max_over_mean_load_redundant": 1.05, "balance_mode": "redundant", "balance_over_off_speedup": 1.58,
         "balance_over_best_speedup": 0.99},
    ]
    summary = summarize(records)
    assert summary["strong_skew_goal_met"] and summary["uniform_goal_met"] and summary["redundant_goal_met"]
    assert summary["balance_goal_met"] and summary["balance_mode"] == {"u": "off", "z": "redundant"}
    assert not summarize([{**records[0], "balance_over_off_speedup": 0.96}])["balance_goal_met"]
    assert not summarize([{**records[1], "balance_over_best_speedup": 0.94}])["balance_goal_met"]
    assert not summarize([{**records[1], "max_over_mean_load_redundant": 1.2}])["redundant_goal_met"]
    assert not summarize([{**records[0], "auto_over_off_speedup": 0.9}])["uniform_goal_met"]
