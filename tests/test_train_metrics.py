"""The trainer's MoE health: every step record holds the monitor's figures (equal to the layers'
own records), the alerts are said once on the log and kept in metrics.jsonl (also over a resume),
--tensorboard and --metrics-csv write what TensorBoard's reader and a CSV reader find, and the
default (dropless) run drops nothing and says nothing."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from moeflow.data import stdlib_directory
from moeflow.training import TrainConfig
from moeflow.training.launch import run_training
from moeflow.training.metrics import METRICS_CSV, TENSORBOARD, iterate_records

TINY: dict[str, Any] = dict(
    data=str(stdlib_directory() / "json"), vocab_size=512, context=32, layers=2, heads=2, model_dim=32,
    hidden_dim=64, num_experts=4, top_k=2, batch_size=4, steps=4, eval_interval=2, eval_windows=8,
    checkpoint_interval=4, warmup_steps=2, lr=1e-2, min_lr=1e-3, pipeline=1, alltoall="linear", progress=False,
)


@pytest.mark.distributed
def test_a_dropping_run_alerts_once_and_every_sink_holds_the_health(
    tmp_path: Path, corpus_cache: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from moeflow.cli import main

    run_dir = tmp_path / "run"  # interrupted at step 2 and resumed: the checkpoint keeps the alerts said
    dropping = {**TINY, "run_dir": str(run_dir), "capacity_factor": 0.25, "tensorboard": True, "metrics_csv": True,
                "checkpoint_interval": 2}
    run_training(TrainConfig(**dropping, stop_at=2), report=False)
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    records = list(iterate_records(run_dir))
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    for record in records:
        for moe, health in zip(record["moe"], record["health"]["layers"], strict=True):
            assert health["tokens_per_expert"] == moe["tokens_per_expert"]  # one forward a step: the same counts
            assert health["dropped"] == moe["dropped"] > 0
        assert 0 <= record["monitor_s"] < record["step_s"]
    alerts = [alert for record in records for alert in record.get("alerts", [])]
    assert [(alert["kind"], alert["step"]) for alert in alerts] == [("drops", 1)] * 2  # each block once, in all
    said = capfd.readouterr().err
    assert said.count("moeflow train: warning: block 1 dropped") == 1 and "--capacity-factor" in said

    rows = list(csv.DictReader((run_dir / METRICS_CSV).open()))
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4]
    assert [row["train/val_loss"] != "" for row in rows] == [False, True, False, True]
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    reader = event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD), size_guidance={"histograms": 0})
    reader.Reload()
    assert {"train/loss", "train/val_loss", "train/tokens_per_s", "moe/block1/dropped_share",
            "moe/block1/router_entropy", "moe/alltoall_share"} <= set(reader.Tags()["scalars"])
    loads = reader.Histograms("moe/block1/load")
    assert [list(event.histogram_value.bucket) for event in loads] == [
        next(layer["tokens_per_expert"] for layer in record["health"]["layers"] if layer["block"] == 1)
        for record in records]


def test_the_alert_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="alert_dropped_share must be in"):
        TrainConfig(alert_dropped_share=0)
    with pytest.raises(ValueError, match="alert_dead_window must be >= 1"):
        TrainConfig(alert_dead_window=0)


@pytest.mark.distributed
def test_generate_writes_the_health_of_every_workers_tokens(tmp_path: Path, corpus_cache: Path) -> None:
    from moeflow.training.generate import generate_text

    run_dir = tmp_path / "run"
    run_training(TrainConfig(**{**TINY, "run_dir": str(run_dir), "steps": 2}))
    records = list(iterate_records(run_dir))  # the default capacity factor: dropless, so no drops alert
    assert [layer["dropped"] for record in records for layer in record["health"]["layers"]] == [0] * 4
    assert not any("alerts" in record for record in records)
    figures = {}
    for workers in (1, 2):
        path = tmp_path / f"health-{workers}.jsonl"
        text = generate_text(str(run_dir), "{", new_tokens=6, workers=workers, health_path=path)
        figures[workers] = json.loads(path.read_text())["layers"]
        assert text.startswith("{")
    for one, two in zip(figures[1], figures[2], strict=True):  # both workers sample the same tokens
        assert [2 * count for count in one["tokens_per_expert"]] == two["tokens_per_expert"]
        assert one["router_entropy"] == pytest.approx(two["router_entropy"], rel=1e-5)
        assert one["bytes_sent"] == 0 < two["bytes_sent"]
