"""`moeflow train --pp-size`: a pipelined run trains, resumes exactly, and its checkpoint (each
rank's stages, the model's names) resumes at another layout that reads the same batches; bad
pipeline settings are refused by name before any worker starts."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from moeflow.training import TrainConfig
from moeflow.training.launch import resume_config, run_training
from moeflow.training.metrics import iterate_records
from test_training import TINY

PIPELINED: dict[str, Any] = {
    **TINY, "layers": 4, "workers": 4, "pp_size": 2, "ep_size": 2, "steps": 4, "checkpoint_interval": 2,
    "eval_interval": 2, "capacity_factor": 0.0, "aux_loss_weight": 0.0,  # dropless, no aux loss: the whole
}   # batch's loss is the mean of its micro-batches' (what a layout without a pipeline computes)


def _losses(run_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in iterate_records(run_dir)}


def _resumed(source: Path, target: Path, **overrides: Any) -> dict[int, float]:
    """The run in ``source`` resumed from its checkpoint in a copy at ``target`` with ``overrides``."""
    shutil.copytree(source, target)
    config, checkpoint = resume_config(str(target), {"run_dir": str(target), **overrides})
    run_training(config, checkpoint, report=False)
    return _losses(target)


@pytest.mark.distributed
def test_a_pipelined_run_resumes_exactly_and_at_other_layouts(tmp_path: Path) -> None:
    """P 2 x EP 2 on 4 workers, stopped after step 2: resumed as it was, bit for bit; at P 2 x DP 2
    (the experts copied, not split), at P 1 on 2 workers (no pipeline, EP 2), at P 1 x EP 4 (half
    the batch on each of 4 workers) and on one process (the whole global batch), the same global
    batch gives the same losses within the summation order's rounding."""
    whole = summary = run_training(TrainConfig(**{**PIPELINED, "run_dir": str(tmp_path / "whole")}), report=False)
    assert (summary["pp_size"], summary["ep_size"], summary["microbatches"]) == (2, 2, 2)
    expected = _losses(tmp_path / "whole")
    assert list(expected) == [1, 2, 3, 4] and expected[4] < expected[1]
    run_training(TrainConfig(**{**PIPELINED, "run_dir": str(tmp_path / "stopped"), "stop_at": 2}), report=False)
    assert _losses(tmp_path / "stopped") == {step: expected[step] for step in (1, 2)}
    assert _resumed(tmp_path / "stopped", tmp_path / "same") == expected
    batch = PIPELINED["batch_size"]
    for name, overrides in (("dp2", {"ep_size": 1}), ("p1", {"pp_size": 1, "workers": 2, "ep_size": None}),
                            ("p1-ep4", {"pp_size": 1, "ep_size": None, "batch_size": batch // 2}),
                            ("one", {"pp_size": 1, "workers": 1, "ep_size": None, "batch_size": 2 * batch})):
        resumed = _resumed(tmp_path / "stopped", tmp_path / name, **overrides)
        assert list(resumed) == [1, 2, 3, 4], name
        for step in (3, 4):
            assert resumed[step] == pytest.approx(expected[step], rel=1e-5), (name, step)
    assert whole["val_loss"] is not None
    from moeflow.cli import main

    assert main(["export", str(tmp_path / "whole"), "--out", str(tmp_path / "export")]) == 0
    exported = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f"blocks.{block}.ffn.experts.w1" for block in range(4)} <= set(exported)  # every stage's blocks
    assert main(["generate", "--checkpoint", str(tmp_path / "whole"), "--prompt", "def ", "--max-new-tokens",
                 "4"]) == 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"pp_size": 3}, "workers=4 is not a multiple of pp_size=3"),
    ({"layers": 1}, "makes 2 stages and the model has layers=1"),
    ({"microbatches": 3}, "microbatches=3 must be at least the 2 stages"),
    ({"pp_schedule": "dualpipev", "batch_size": 2}, "at least the 4 stages of --pp-schedule dualpipev and divide"),
    ({"pp_schedule": "zb"}, "pp_schedule='zb' is unknown"),
    ({"dtype": "bf16"}, "--dtype bf16 does not run with --pp-size yet"),
    ({"ep_size": 4}, "is not a multiple of ep_size=4"),
    ({"pp_size": 1, "microbatches": 2}, "--microbatches splits a pipelined step"),
])
def test_pipeline_settings_that_cannot_run_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**PIPELINED, **changes})


@pytest.mark.distributed
def test_a_stage_rank_stopped_mid_step_ends_the_job_within_the_timeout_and_is_named(tmp_path: Path) -> None:
    """The hang drill: stage 1's second expert-parallel worker stopped at its first forward
    all-to-all of step 2 (SIGSTOP); the job fails within the collective timeout, naming it."""
    from moeflow.distributed import WorkerError
    from moeflow.training.faults import FaultPlan, WorkerFault

    config = TrainConfig(**{**PIPELINED, "run_dir": str(tmp_path / "drill"), "collective_timeout_s": 5.0})
    began = time.monotonic()
    with pytest.raises(WorkerError, match="worker 3 of 4 is stopped"):
        run_training(config, report=False, faults=FaultPlan(workers=(WorkerFault("stop", 3, "forward", step=2),)))
    assert time.monotonic() - began < 60


def test_a_resumed_worker_takes_back_its_own_planners_or_each_blocks_first() -> None:
    """Saved by 4 workers of 2 stages: the same layout resumes each worker's own, another takes
    each block's first holder's; a run without a pipeline reads them in block order, and a
    pipelined one reads a run without a pipeline's rank 0 by block."""
    from moeflow.training.pipeline_trainer import planners_by_block
    from moeflow.training.trainer import rank_planner_states

    saved = {"planners_by_rank_block": [{"0": "a0", "1": "a1"}, {"0": "b0", "1": "b1"}, {"2": "c2", "3": "c3"},
                                        {"2": "d2", "3": "d3"}]}  # as state.json keeps them: str keys
    assert planners_by_block(saved, 1, 4, [0, 1, 2, 3]) == {0: "b0", 1: "b1"}
    assert planners_by_block(saved, 0, 2, [0, 1, 2, 3]) == {0: "a0", 1: "a1", 2: "c2", 3: "c3"}
    assert rank_planner_states(saved, 1, 2) == ["a0", "a1", "c2", "c3"]
    unpipelined = {"planners_by_rank": [["r0", "r1"], ["s0", "s1"]]}
    assert planners_by_block(unpipelined, 3, 4, [1, 3]) == {1: "r0", 3: "r1"}
