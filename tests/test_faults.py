"""Faults end the job fast and lose nothing: a worker killed, stopped or delayed at each phase of
training and generation (the drill of ``moeflow bench faults``, one fault per phase here; the
bench runs every fault on every worker), and checkpoints that are damaged or cannot be written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moeflow.bench.faults import FAULT_STEP, Drill, drill_config, handled, run_drill
from moeflow.distributed import WorkerError
from moeflow.training.checkpoint import CheckpointWarning, checkpoint_problem, latest_checkpoint, resumable_checkpoint
from moeflow.training.launch import resume_config, run_training

TIMEOUT_S = 5.0
DRILLS = [
    Drill("kill", 1, "forward"),
    Drill("stop", 0, "backward"),
    Drill("stop", 1, "gradient sync", "after"),
    Drill("kill", 0, "gradient sync", "overlap"),
    Drill("stop", 1, "gradient sync", "lina"),
    Drill("kill", 1, "checkpoint"),
    Drill("stop", 0, "evaluation"),
    Drill("stop", 1, "generation"),
    Drill("delay", 0, "backward"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished drill run: two checkpoints (steps 2 and 4), the newest to generate from."""
    run_dir = tmp_path_factory.mktemp("faults") / "trained"
    run_training(drill_config(run_dir, "after", TIMEOUT_S), report=False)
    return run_dir


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: f"{d.kind}-{d.worker}-{d.phase}-{d.grad_sync}")
@pytest.mark.slow
@pytest.mark.fresh_workers  # a drill counts the processes the job leaves behind: none of the suite's may be there
def test_a_fault_ends_the_job_within_the_timeout_and_keeps_a_resumable_checkpoint(
    drill: Drill, trained: Path, tmp_path: Path
) -> None:
    resume = drill.phase in ("checkpoint", "gradient sync") and drill.grad_sync == "after"
    record = run_drill(drill, tmp_path / "run", TIMEOUT_S, resume=resume, trained=trained)
    assert handled(record, TIMEOUT_S), record
    if drill.kind != "delay":
        assert record["exit_s"] < TIMEOUT_S + 10
        if drill.phase != "generation":
            assert record["checkpoint_step"] == FAULT_STEP - 2  # the save of the fault's step never completed
        if drill.kind == "stop":
            assert f"worker {drill.worker} of 2 is stopped" in record["report"][0]
    if resume:
        assert record["resumed_to"] == FAULT_STEP


def _damaged_copy(trained: Path, tmp_path: Path, name: str, damage: str) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = latest_checkpoint(run_dir)
    assert newest is not None and newest.name == f"step-{FAULT_STEP:06d}"
    path = newest / name
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # one flipped byte in the middle: the size stays
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    return run_dir, path


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
@pytest.mark.parametrize("name", ["__1_0.distcp", ".metadata", "state.json"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    trained: Path, tmp_path: Path, name: str, damage: str
) -> None:
    run_dir, path = _damaged_copy(trained, tmp_path, name, damage)
    assert checkpoint_problem(path.parent) is not None
    with pytest.warns(CheckpointWarning, match=f"checkpoint step-{FAULT_STEP:06d} is damaged: .*{name}"):
        checkpoint = resumable_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.name == f"step-{FAULT_STEP - 2:06d}"
    with pytest.raises(ValueError, match=f"cannot resume from .*{name}"):
        resumable_checkpoint(path.parent)  # named itself: no silent fallback


@pytest.mark.slow
def test_resume_from_a_damaged_checkpoint_warns_naming_the_file_and_continues(trained: Path, tmp_path: Path) -> None:
    run_dir, path = _damaged_copy(trained, tmp_path, "__0_0.distcp", "corrupt")
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "train", "--resume", str(run_dir), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint step-{FAULT_STEP:06d} is damaged: {path} is corrupt" in result.stderr
    assert latest_checkpoint(run_dir).name == f"step-{FAULT_STEP:06d}"  # saved again, whole
    assert checkpoint_problem(latest_checkpoint(run_dir)) is None
    assert resume_config(str(run_dir), {})[1].name == f"step-{FAULT_STEP:06d}"


@pytest.fixture()
def small_disk(tmp_path: Path) -> Path:
    """A 1.6 MiB tmpfs: room for one drill checkpoint (1 MiB) and not for a second."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_hidden_in_torch_saves_zip_error_is_still_named(tmp_path: Path, monkeypatch) -> None:
    """``torch.save``'s zip writer reports running out of space as a RuntimeError ("unexpected
    pos"), which DCP gathers from the rank: with the device (nearly) full, it is a full disk."""
    import collections

    from torch.distributed.checkpoint.api import CheckpointException

    from moeflow.training import checkpoint

    root = tmp_path / "checkpoints"
    partial = root / ".step-000004.tmp"
    partial.mkdir(parents=True)
    gathered = CheckpointException("save", {1: (RuntimeError("unexpected pos 704 vs 598"), None)})
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(2 << 20, 2 << 20, 4096))
    error = checkpoint._save_failed(gathered, partial, root)
    assert isinstance(error, OSError) and "no space left on the device for checkpoint step-000004" in str(error)
    assert not partial.exists()
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(2 << 30, 0, 2 << 30))
    assert checkpoint._save_failed(gathered, root, root) is gathered  # room left: some other failure


def test_a_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    with pytest.raises(WorkerError, match="no space left on the device for checkpoint step-000004") as raised:
        run_training(drill_config(run_dir, "after", TIMEOUT_S), report=False)
    assert "the previous checkpoint step-000002 is intact" in str(raised.value)
    kept = latest_checkpoint(run_dir)
    assert kept is not None and kept.name == "step-000002" and checkpoint_problem(kept) is None
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # the partial save is gone
