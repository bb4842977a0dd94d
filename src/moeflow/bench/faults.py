"""``moeflow bench faults``: the fault drill. Each fault (kill, stop, delay) on each of 2 workers at
each phase of a small training run (forward, backward, the gradient sync under each ``--grad-sync``,
checkpoint save, evaluation) and of a generation: how long the job took to end after the fault,
whether its message named the worker and the phase, and what it kept (the last checkpoint, resumed).

A fault fires as its worker enters its first collective of the phase at step :data:`FAULT_STEP`
(:mod:`moeflow.training.faults`); the seconds to exit count from that moment (the worker's
progress file says when) to the launcher's error.
"""

from __future__ import annotations

import multiprocessing
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeflow.comm.ledger import ProgressBeacon
from moeflow.data import stdlib_directory
from moeflow.distributed import WorkerError
from moeflow.files import print_json
from moeflow.progress import Progress, Quiet
from moeflow.training.checkpoint import latest_checkpoint
from moeflow.training.config import TrainConfig
from moeflow.training.faults import FAULT_KINDS, FaultPlan, WorkerFault
from moeflow.training.generate import generate_text
from moeflow.training.launch import run_training
from moeflow.training.metrics import PROGRESS

FAULT_STEP = 4
"""The step the faults fire in: the run's last, with an evaluation and a checkpoint (the one before
is at step 2: what a failed run keeps)."""
DRILL_RUN: dict[str, Any] = dict(
    vocab_size=512, context=32, layers=2, heads=2, model_dim=32, hidden_dim=64, num_experts=4, top_k=2,
    batch_size=4, steps=FAULT_STEP, eval_interval=2, eval_windows=8, checkpoint_interval=2, warmup_steps=1,
    pipeline=1, alltoall="linear", progress=False, workers=2,
)
"""A small 2-worker run that evaluates and checkpoints every 2 steps."""
PHASE_TEXT = {
    "forward": "forward", "backward": "backward", "gradient sync": "gradient", "checkpoint": "checkpoint save",
    "evaluation": "(evaluation)", "generation": "(generation)",
}
"""What the failure message must contain to name each phase."""


@dataclass(frozen=True)
class Drill:
    """One fault: ``kind`` on ``worker`` at ``phase`` (the gradient sync under ``grad_sync``)."""

    kind: str
    worker: int
    phase: str
    grad_sync: str = "after"

    @property
    def fault(self) -> WorkerFault:
        """The fault as the fault plan carries it (generation has no steps)."""
        return WorkerFault(self.kind, self.worker, self.phase, None if self.phase == "generation" else FAULT_STEP,
                           seconds=DELAY_S)


DELAY_S = 2.0
"""A delay's length: well under any collective timeout the drill uses."""


def drill_config(run_dir: Path, grad_sync: str, collective_timeout_s: float) -> TrainConfig:
    """The drill's training run in ``run_dir`` (Python's ``json`` package as its text)."""
    return TrainConfig(**DRILL_RUN, data=str(stdlib_directory() / "json"), run_dir=str(run_dir),
                       grad_sync=grad_sync, collective_timeout_s=collective_timeout_s)


def run_drill(
    drill: Drill, folder: Path, timeout_s: float, resume: bool, trained: Path | None = None
) -> dict[str, Any]:
    """Run one drill in ``folder``; ``trained``: a finished run to generate from (generation)."""
    began, progress_dir = time.time(), folder / PROGRESS
    try:
        if drill.phase == "generation":
            assert trained is not None
            generate_text(str(trained), "def ", new_tokens=8, workers=2, faults=FaultPlan(workers=(drill.fault,)),
                          collective_timeout_s=timeout_s, progress_dir=progress_dir)
        else:
            run_training(drill_config(folder, drill.grad_sync, timeout_s), report=False,
                         faults=FaultPlan(workers=(drill.fault,)))
        message, ended = "", "completed"
    except WorkerError as error:
        message, ended = str(error), "failed"
    finished = time.time()
    fired = _fired_at(progress_dir, drill.worker, began)
    record = {
        "fault": drill.kind, "worker": drill.worker, "phase": drill.phase, "grad_sync": drill.grad_sync,
        "ended": ended, ("exit_s" if ended == "failed" else "run_s"): finished - fired,
        "names_worker": _names_worker(message, drill.worker),
        "names_phase": PHASE_TEXT[drill.phase] in message, "left_behind": len(multiprocessing.active_children()),
        "report": _report_lines(message),
    }
    if drill.phase != "generation":
        record.update(_kept(folder, drill.grad_sync, timeout_s, resume and ended == "failed"))
    return record


def _fired_at(progress_dir: Path, worker: int, began: float) -> float:
    """When the fault fired: the faulted worker's entry into the phase's collective (its progress
    file), else (no fault fired) the start."""
    entered = [entry.entered for entry in ProgressBeacon.open_entries(progress_dir, worker)]
    return max(entered, default=began)


def _names_worker(message: str, worker: int) -> bool:
    return re.search(rf"worker {worker} of 2 (is stopped|died|has exited|.*made no progress)", message) is not None


def _report_lines(message: str) -> list[str]:
    """The failure's first line and the hang report's lines (the traceback left out)."""
    lines = message.splitlines()
    report = [line for line in lines[1:] if line.startswith(("moeflow.comm.ledger", "worker ", "desync"))]
    return lines[:1] + list(dict.fromkeys(report))


def _kept(folder: Path, grad_sync: str, timeout_s: float, resume: bool) -> dict[str, Any]:
    """The last checkpoint's step; with ``resume``, whether the run resumed from it to its end."""
    checkpoint = latest_checkpoint(folder)
    kept: dict[str, Any] = {"checkpoint_step": None if checkpoint is None else int(checkpoint.name.split("-")[-1])}
    if resume and checkpoint is not None:
        summary = run_training(drill_config(folder, grad_sync, timeout_s), checkpoint=checkpoint, report=False)
        kept["resumed_to"] = summary.get("steps")
    return kept


def drills(grad_syncs: tuple[str, ...] = ("after", "overlap", "lina")) -> list[Drill]:
    """Every fault on every worker at every phase, the gradient sync under each mode."""
    phases = [("forward", "after"), ("backward", "after"), *[("gradient sync", mode) for mode in grad_syncs],
              ("checkpoint", "after"), ("evaluation", "after"), ("generation", "after")]
    return [Drill(kind, worker, phase, mode) for phase, mode in phases for kind in FAULT_KINDS for worker in (0, 1)]


def run(timeout_s: float, resume: bool, kinds: tuple[str, ...] = FAULT_KINDS, progress: Progress | None = None) -> int:
    """The whole drill, one JSON line per fault and a summary; 1 if any fault was not handled.
    ``progress`` counts the faults drilled."""
    chosen, progress = [d for d in drills() if d.kind in kinds], progress or Quiet()
    progress.expect(len(chosen))
    with tempfile.TemporaryDirectory(prefix="moeflow-faults-") as scratch:
        trained = Path(scratch) / "trained"
        progress.note("the run to generate from")
        run_training(drill_config(trained, "after", timeout_s), report=False)
        records = []
        for index, drill in enumerate(chosen):
            progress.note(f"{drill.kind} worker {drill.worker}: {drill.phase}"
                          + (f" ({drill.grad_sync})" if drill.phase == "gradient sync" else ""))
            record = run_drill(drill, Path(scratch) / f"drill-{index}", timeout_s, resume, trained)
            records.append(record)
            print_json({**record, "report": " | ".join(record["report"])})
            progress.advance()
    bad = [r for r in records if not handled(r, timeout_s)]
    worst = max((r["exit_s"] for r in records if r["ended"] == "failed"), default=0.0)
    print(f"fault drill: {len(records) - len(bad)} of {len(records)} faults handled; slowest exit {worst:.1f} s "
          f"after the fault (collective timeout {timeout_s:.0f} s, bound {timeout_s + 10:.0f} s)")
    return 1 if bad else 0


def handled(record: dict[str, Any], timeout_s: float) -> bool:
    """A delay: the job completes. A kill or a stop: it fails within the timeout + 10 s naming the
    worker and the phase, leaves no worker behind, and keeps a checkpoint that resumes."""
    if record["fault"] == "delay":
        return record["ended"] == "completed"
    kept = record["phase"] == "generation" or (
        record["checkpoint_step"] is not None and record.get("resumed_to", FAULT_STEP) == FAULT_STEP)
    return (record["ended"] == "failed" and record["exit_s"] < timeout_s + 10 and record["names_worker"]
            and record["names_phase"] and record["left_behind"] == 0 and kept)
