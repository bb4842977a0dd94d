"""A pipelined run's MoE health (`moeflow train --pp-size`): each stage watches its own blocks over
its data ranks and rank 0 joins them, so metrics.jsonl holds every block once, counts of every
data rank's tokens and micro-batch, the alerts said once, and the CSV sink written."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from moeflow.metrics import LayerHealth, StepHealth
from moeflow.metrics.alerts import DROPS, HealthRules
from moeflow.metrics.stages import StageHealth, merge_stages
from moeflow.training import TrainConfig
from moeflow.training.launch import run_training
from moeflow.training.metrics import METRICS_CSV, iterate_records
from test_pipeline_training import PIPELINED


@pytest.mark.distributed
def test_a_pipelined_run_records_every_blocks_health_once_and_alerts_once(
    tmp_path: Path, corpus_cache: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """P 2 x EP 2 on 4 workers, 2 micro-batches a step, dropping (capacity factor 0.25): every
    block's counts are the step's assignments before capacity over both data ranks; an evaluation
    (step 2) does not count in the next step; each block's drops alert fires once, said by rank 0,
    also over a resume (the checkpoint keeps the alerts said)."""
    from moeflow.cli import main

    run_dir = tmp_path / "run"
    config: dict[str, Any] = {**PIPELINED, "run_dir": str(run_dir), "steps": 3, "eval_interval": 2,
                              "checkpoint_interval": 2, "capacity_factor": 0.25, "metrics_csv": True}
    run_training(TrainConfig(**config, stop_at=2), report=False)
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    records = list(iterate_records(run_dir))
    assignments = config["batch_size"] * config["context"] * config["top_k"] * 2  # 2 data ranks per stage
    for record in records:
        layers = record["health"]["layers"]
        assert [layer["block"] for layer in layers] == [0, 1, 2, 3]
        assert [sum(layer["tokens_per_expert"]) for layer in layers] == [assignments] * 4, record["step"]
        assert all(layer["dropped"] > 0 and layer["router_entropy"] is not None for layer in layers)
        assert 0 <= record["monitor_s"] < record["step_s"]
    alerts = [(alert["kind"], alert["block"], alert["step"]) for r in records for alert in r.get("alerts", [])]
    assert alerts == [(DROPS, block, 1) for block in range(4)]
    said = capfd.readouterr().err
    assert said.count("moeflow train: warning: block 3 dropped") == 1  # stage 1's, said by rank 0
    rows = list(csv.DictReader((run_dir / METRICS_CSV).open()))
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    assert all(row["moe/block0/dropped_share"] and row["moe/block3/dropped_share"] for row in rows)


def _layer(block: int, counts: list[int], dropped: int = 0) -> LayerHealth:
    return LayerHealth(
        block=block, tokens_per_expert=counts, load_max_over_mean=1.0, load_cv=0.0, busiest_share=0.5,
        dead_experts=[], dropped=dropped, dropped_share=dropped / sum(counts), router_entropy=None, bias_min=0.0,
        bias_max=0.0, schedule=None, pipeline_degree=None, alltoall=None, token_exchange=None, bytes_sent=0,
        alltoall_s=0.3, alltoall_share=None)


def test_the_stages_join_in_block_order_and_the_alerts_see_the_whole_model() -> None:
    """Each block once and in order, ranks without a stage's report skipped, a block twice refused;
    the all-to-all alert weighs every stage's layers against the one step (0.3 s each of 1 s)."""
    first = StepHealth(4, 1.1, [_layer(0, [2, 2]), _layer(1, [1, 3], dropped=2)])
    second = StepHealth(4, 0.9, [_layer(2, [4, 0])])
    assert [layer.block for layer in merge_stages(4, 1.0, [second, None, first]).layers] == [0, 1, 2]
    with pytest.raises(ValueError, match="reported by two stages"):
        merge_stages(4, 1.0, [first, first])
    health = StageHealth(HealthRules(warmup_steps=0)).merge(4, 1.0, [first, None, second])
    assert health.step_s == 1.0 and health.alltoall_share == pytest.approx(0.9)
    assert [(alert.kind, alert.block) for alert in health.alerts] == [(DROPS, 1), ("alltoall", None)]
