"""The monitor's sinks: JSONL records, a CSV a spreadsheet opens (kept through a resume), and
TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from moeflow import MoEConfig, MoELayer
from moeflow.metrics import CsvSink, JsonlSink, MoEMonitor, TensorBoardSink


def _steps(tmp_path: Path, sinks: list[object], steps: int = 3) -> list[object]:
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=8, hidden_dim=16, num_experts=4, top_k=2))
    monitor = MoEMonitor(layer, sinks=sinks)
    healths = []
    for _ in range(steps):
        layer(torch.randn(32, 8, requires_grad=True)).sum().backward()
        healths.append(monitor.step())
    monitor.close()
    return healths


def test_jsonl_and_csv_hold_every_step(tmp_path: Path) -> None:
    healths = _steps(tmp_path, [JsonlSink(tmp_path / "health.jsonl"), CsvSink(tmp_path / "health.csv")])
    records = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [r["layers"][0]["tokens_per_expert"] for r in records] == [h.layers[0].tokens_per_expert for h in healths]
    rows = list(csv.DictReader((tmp_path / "health.csv").open()))
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    assert [float(row["moe/block0/load_cv"]) for row in rows] == pytest.approx([h.layers[0].load_cv for h in healths])


def test_a_resumed_csv_keeps_its_rows_through_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    sink = CsvSink(path, columns=["train/loss"])
    for step in (1, 2, 3):
        sink.write(step, {"moe/x": float(step)}, {}, {})
    sink.close()
    resumed = CsvSink(path, keep_through=2, columns=["train/loss"])
    resumed.write(3, {"moe/x": 30.0, "train/loss": 1.5}, {}, {})
    resumed.close()
    rows = list(csv.DictReader(path.open()))
    assert [(row["step"], row["moe/x"], row["train/loss"]) for row in rows] == [
        ("1", "1.0", ""), ("2", "2.0", ""), ("3", "30.0", "1.5")]


def test_tensorboard_holds_the_scalars_and_load_histograms(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    healths = _steps(tmp_path, [TensorBoardSink(tmp_path / "tb")])
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    reader.Reload()
    tags = reader.Tags()
    assert {"moe/block0/load_cv", "moe/block0/router_entropy", "moe/block0/dropped_share"} <= set(tags["scalars"])
    assert [e.value for e in reader.Scalars("moe/block0/load_cv")] == pytest.approx(
        [h.layers[0].load_cv for h in healths])
    histograms = reader.Histograms("moe/block0/load")
    assert [list(e.histogram_value.bucket) for e in histograms] == [h.layers[0].tokens_per_expert for h in healths]
    assert [e.step for e in histograms] == [1, 2, 3]
