"""`moeflow bench memory` at tiny sizes on 1 and 2 workers: a record per worker and scenario (plain
and scheduled generation, training, a user's loop with FSDP2-sharded experts) with positive peak,
share and ratio, and a share that shrinks when the experts are split over 2 workers. No figure is
compared with a target: at these sizes the workers' fixed cost (code) dominates."""

from __future__ import annotations

import json
from typing import Any

import pytest

from moeflow.cli import main
from moeflow.data import stdlib_directory

pytest.importorskip("transformers")

TINY = ["--layers", "1", "--model-dim", "32", "--hidden-dim", "64", "--num-experts", "4", "--steps", "1",
        "--data", str(stdlib_directory() / "json"), "--vocab-size", "512"]
COMMON_KEYS = {"bench", "scenario", "workers", "rank", "peak_bytes", "baseline_bytes", "above_baseline_bytes",
               "share_bytes", "ratio", "parameters", "non_expert_bytes", "expert_bytes", "model_bytes",
               "local_experts", "num_experts", "ru_maxrss_bytes", "cuda_peak_allocated_bytes"}
TRAINING_KEYS = {"state_bytes", "activation_bytes", "peak_save_bytes", "peak_resume_bytes", "steps", "checkpoint"}


def _check_record(record: dict[str, Any]) -> None:
    assert record["bench"] == "memory"
    assert record.keys() >= COMMON_KEYS
    assert record["peak_bytes"] > record["baseline_bytes"] > 0
    assert record["share_bytes"] > 0 and record["ratio"] > 0
    assert record["ratio"] == pytest.approx(record["above_baseline_bytes"] / record["share_bytes"], rel=1e-3)
    expert_ranks = record.get("ep", record["workers"])  # the layout scenarios: EP = workers / 2
    assert record["local_experts"] == [4 // expert_ranks]  # the layer's placement: expert parallel
    local = record["non_expert_bytes"] + record["expert_bytes"]
    assert (record["model_bytes"] > local) == (expert_ranks > 1) and record["model_bytes"] >= local
    if record["scenario"].endswith("generation"):
        assert record["share_bytes"] == record["non_expert_bytes"] + record["expert_bytes"]
    elif record["scenario"] == "sharded-experts":  # 16 B per parameter, the experts over EP x DP
        assert record["dp"] * record["ep"] == record["workers"] and record["activation_bytes"] > 0
        per_rank = record["non_expert_bytes"] + record["expert_bytes"] // record["dp"]
        assert record["state_bytes"] == 4 * per_rank == record["share_bytes"] - record["activation_bytes"]
    else:
        assert record.keys() >= TRAINING_KEYS and record["checkpoint"] == "step-000001"
        assert record["state_bytes"] == 16 * record["parameters"] and record["activation_bytes"] > 0
        assert record["share_bytes"] == record["state_bytes"] + record["activation_bytes"]
        assert record["peak_bytes"] == max(record["peak_save_bytes"], record["peak_resume_bytes"])


@pytest.mark.distributed
@pytest.mark.fresh_workers  # each worker's peak memory is its own process's high-water mark
def test_bench_memory_reports_every_worker_and_its_share_shrinks_with_workers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    scenarios = ["generation", "scheduled-generation", "training", "sharded-experts"]
    assert main(["bench", "memory", "--workers", "1", "2", "--skip-imports", "--scenarios", *scenarios, *TINY]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    *records, summary = lines
    assert [(r["scenario"], r["workers"], r["rank"]) for r in records] == [
        (scenario, workers, rank) for scenario in scenarios for workers, rank in [(1, 0), (2, 0), (2, 1)]]
    for record in records:
        _check_record(record)
    for scenario in scenarios:
        share = {r["workers"]: r["share_bytes"] for r in records if r["scenario"] == scenario}
        assert share[2] < share[1], scenario
    assert summary["summary"] == "memory" and set(summary["worst_ratio"]) == set(scenarios)
    assert [t["target"].split(":")[0] for t in summary["targets"]] == scenarios


def test_bench_memory_refuses_workers_that_do_not_divide_the_experts() -> None:
    with pytest.raises(SystemExit, match="not divisible by --workers"):
        main(["bench", "memory", "--workers", "3", *TINY])
    with pytest.raises(SystemExit, match="--workers 3: the layout scenarios run EP = workers / 2"):
        main(["bench", "memory", "--workers", "3", "--scenarios", "sharded-experts", *TINY[:6], "--num-experts", "6"])
