"""The scripts in examples/ run, at tiny sizes, and do what their docstrings say: each is started
as a user would (a subprocess; train_loop also under torchrun) and its last line, a JSON summary,
is checked."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moeflow.distributed import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TESTED = {"train_loop.py", "train_loop_fsdp2.py", "convert_hf.py", "plan_cluster.py", "hf_expert_parallel.py",
          "pipeline_loop.py"}
TINY_TRAINING = ["--steps", "12", "--batch", "4", "--sequence", "16", "--vocab", "32", "--model-dim", "16",
                 "--hidden-dim", "32", "--num-experts", "4"]


def run_example(*argv: str, timeout: float = 300) -> dict[str, Any]:
    """Run a command from the repository root; return the JSON summary on its last line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, *argv], cwd=EXAMPLES.parent, capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    summary["stdout"] = result.stdout
    return summary


def test_every_example_is_tested_and_says_how_to_run_it() -> None:
    scripts = {path.name: path for path in EXAMPLES.glob("*.py")}
    assert set(scripts) == TESTED  # a new example needs a test here
    for name, path in scripts.items():
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert f"examples/{name}" in docstring, f"{name}'s docstring does not say how to run it"


@pytest.mark.slow
def test_train_loop_as_one_process() -> None:
    summary = run_example("examples/train_loop.py", *TINY_TRAINING)
    assert summary["example"] == "train_loop" and summary["world_size"] == 1 and summary["steps"] == 12
    assert summary["last_loss"] < 0.7 * summary["first_loss"]
    assert "tokens per expert" in summary["stdout"]


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["train_loop", "train_loop_fsdp2"])
def test_train_loop_under_torchrun_on_two_processes(script: str) -> None:
    summary = run_example("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), f"examples/{script}.py", *TINY_TRAINING)
    assert summary["example"] == script and summary["world_size"] == 2
    assert summary["last_loss"] < 0.7 * summary["first_loss"]
    assert summary["stdout"].count('"example"') == 1  # rank 0 alone reports


@pytest.mark.distributed
def test_pipeline_loop_trains_in_two_stages_of_two_expert_parallel_ranks_under_torchrun() -> None:
    summary = run_example("-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), "examples/pipeline_loop.py", "--pp", "2", "--ep", "2",
                          "--steps", "20")
    assert summary["example"] == "pipeline_loop" and summary["world_size"] == 4
    assert summary["blocks_here"] == [0, 1]  # rank 0 builds the first stage's blocks only
    assert summary["last_loss"] < 0.7 * summary["first_loss"]


@pytest.mark.distributed
def test_hf_expert_parallel_fine_tunes_and_generates_under_torchrun() -> None:
    pytest.importorskip("transformers")
    summary = run_example("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), "examples/hf_expert_parallel.py", "--steps", "12",
                          "--batch", "4", "--sequence", "16")
    assert summary["example"] == "hf_expert_parallel" and summary["world_size"] == 2
    assert summary["last_loss"] < 0.7 * summary["first_loss"] and summary["new_tokens"] == 8
    assert summary["stdout"].count('"example"') == 1  # rank 0 alone reports


@pytest.mark.slow
def test_convert_hf_matches_transformers_and_generates() -> None:
    pytest.importorskip("transformers")
    for family in ("mixtral", "qwen3_moe"):
        summary = run_example("examples/convert_hf.py", "--family", family, "--new-tokens", "4")
        assert summary["example"] == "convert_hf" and summary["moe_blocks"] == 2
        assert summary["max_logits_error"] < 1e-5 and summary["round_trip_error"] < 1e-5
        assert summary["same_tokens"] and summary["new_tokens"] == 4


@pytest.mark.slow
def test_plan_cluster_names_the_best_plan() -> None:
    summary = run_example("examples/plan_cluster.py", "--cluster", "fastermoe-johnny", "--model", "fastermoe-gpt",
                          "--layers", "2", "--top", "2")
    assert summary["example"] == "plan_cluster" and summary["cluster"] == "fastermoe-johnny"
    assert summary["best_plan"] and 0 < summary["best_ms"] <= summary["baseline_ms"]
    assert f"plan 1    {summary['best_plan']}" in summary["stdout"]
    assert summary["speedup"] == pytest.approx(summary["baseline_ms"] / summary["best_ms"], rel=1e-3)
