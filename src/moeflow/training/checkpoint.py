"""Checkpoints that hold each rank's part, independent of the number of workers, written atomically.

A checkpoint is a folder ``checkpoints/step-NNNNNN`` holding a torch.distributed.checkpoint
(DCP) save of the model and AdamW state (:mod:`moeflow.training.sharded_checkpoint`: every rank
writes its own file with only the experts it holds, the replicated tensors once), ``state.json``
(step, counters, the config, the planners' and the scaler's state) and the tokenizer, so it is
self-contained. Every rank writes into a temporary folder; once all have written (DCP's closing
collective), rank 0 adds ``state.json``, syncs the folder, renames it into place and points
``checkpoints/latest`` at it, so a crash at any moment leaves the previous checkpoint whole.
``state.json`` lists every other file's size and CRC-32: a resume checks them and falls back to
the previous checkpoint, with a warning naming the file, when the newest was damaged since (a
truncated copy, a bad disk). A save that fails (a full disk) removes its temporary folder and
says what to free.
Loading reads only the chunks of each layer's :class:`~moeflow.parallel.ExpertPlacement` in the
loading run: a checkpoint from W workers loads into any placement that fits (expert parallel on
any W' that divides E, replicated, hidden-sharded, packed).

Checkpoints of the earlier single-file format (``model.safetensors`` with full (E, ...) tensors)
still load: each rank slices its part from the full tensors.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moeflow.files import write_atomic
from moeflow.models import TrainableLM
from moeflow.parallel.placement import PlacedParameter
from moeflow.training.sharded_checkpoint import (
    METADATA,
    MOMENTS,
    install_optimizer_state,
    load_sharded,
    model_and_optimizer_state,
    save_sharded,
    saved_keys,
)

CHECKPOINTS = "checkpoints"
"""The folder of a run's checkpoints, one ``step-*`` folder each."""
LATEST = "latest"
"""The file in :data:`CHECKPOINTS` that names the newest checkpoint."""
STATE = "state.json"
"""A checkpoint's progress and config; written last, so its presence marks a complete checkpoint."""
LEGACY_MODEL = "model.safetensors"
"""The model file of the earlier single-file format."""


def save_checkpoint(
    run_dir: Path, step: int, model: TrainableLM, optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None, rank: int, world_size: int, state: dict[str, Any],
    extra_files: list[Path], keep: int, first_expert_copy: bool | None = None,
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically (a collective: every rank writes its part;
    rank 0 completes it) and return its path on every rank. ``first_expert_copy``: whether this
    rank's expert group is the first of its copies, which writes the experts (None: the group
    whose expert ranks are the global ranks, as ``--ep-size`` lays them out)."""
    first_copy = rank == model.groups.rank if first_expert_copy is None else first_expert_copy
    root = run_dir / CHECKPOINTS
    final = root / f"step-{step:06d}"
    temporary = root / f".step-{step:06d}.tmp"
    if rank == 0:  # before DCP's first collective: no rank writes a file before this
        shutil.rmtree(temporary, ignore_errors=True)
        # exist_ok: another rank's DCP writer may create the (still empty) folder meanwhile (seen in CI)
        temporary.mkdir(parents=True, exist_ok=True)
    try:
        save_sharded(temporary, model_and_optimizer_state(model, optimizer, first_copy, primary_only=True), group)
        if rank != 0:
            return final
        for path in extra_files:
            shutil.copy2(path, temporary / path.name)
        files = {file.name: file_fingerprint(file) for file in sorted(temporary.iterdir())}
        state = {**state, "step": step, "world_size": world_size, "files": files}
        (temporary / STATE).write_text(json.dumps(state, indent=2))
    except (OSError, CheckpointException) as error:
        raise _save_failed(error, temporary, root) from error
    for file in temporary.iterdir():
        _fsync(file)
    if final.exists():  # a re-run of the same step replaces it
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync(root)
    write_atomic(root / LATEST, final.name)
    _prune(root, keep)
    return final


LOW_SPACE_BYTES = 1 << 20
"""Below this much free space on the checkpoint's device, a failed save is taken for a full disk."""


def _save_failed(error: OSError | CheckpointException, temporary: Path, root: Path) -> BaseException:
    """The error of a failed save, after its partial folder is removed (the previous checkpoint
    stays the newest): a full disk (on any rank: DCP gathers the ranks' failures) says so. A full
    disk is an ENOSPC, or any failure with under :data:`LOW_SPACE_BYTES` left on the device:
    ``torch.save``'s zip writer reports running out of space as a RuntimeError ("unexpected pos")."""
    gathered = isinstance(error, CheckpointException)
    failures = [failure for failure, _ in error.failures.values()] if gathered else [error]
    full = any(isinstance(failure, OSError) and failure.errno == errno.ENOSPC for failure in failures) or \
        shutil.disk_usage(root).free < LOW_SPACE_BYTES
    shutil.rmtree(temporary, ignore_errors=True)
    if not full:
        return error
    kept = latest_checkpoint(root.parent)
    keeps = f"the previous checkpoint {kept.name} is intact" if kept else "no earlier checkpoint exists"
    free = shutil.disk_usage(root).free / 2**20
    return OSError(errno.ENOSPC, f"no space left on the device for checkpoint {temporary.name[1:-4]} in {root} "
                   f"({free:.1f} MiB free); {keeps}. Free space there, or train with a --run-dir on another disk "
                   "or with fewer --keep-checkpoints")


def file_fingerprint(path: Path) -> list[int]:
    """[size in bytes, CRC-32] of a file, read in blocks (what ``state.json`` records of each file)."""
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return [path.stat().st_size, crc]


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint's files (missing, truncated, corrupt), or None when each
    matches what ``state.json`` recorded (checkpoints without the record are taken as they are)."""
    try:
        recorded = read_state(checkpoint).get("files", {})
    except (OSError, ValueError) as error:
        return f"{checkpoint / STATE} cannot be read ({error})"
    for name, (size, crc) in recorded.items():
        path = checkpoint / name
        if not path.exists():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} is truncated or extended ({path.stat().st_size} bytes, {size} written)"
        if file_fingerprint(path)[1] != crc:
            return f"{path} is corrupt (its CRC-32 differs from the one written)"
    return None


def resumable_checkpoint(path: Path) -> Path | None:
    """The newest checkpoint under a run folder whose files are whole; a damaged newer one is
    skipped with a :class:`CheckpointWarning` naming the file. A checkpoint folder named itself
    must be whole (ValueError otherwise)."""
    if (path / STATE).exists():
        if (problem := checkpoint_problem(path)) is not None:
            raise ValueError(f"cannot resume from {path}: {problem}; pass the run folder to fall back to an older one")
        return path
    root = path / CHECKPOINTS
    for candidate in _complete_newest_first(root):
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        warnings.warn(f"checkpoint {candidate.name} is damaged: {problem}; trying the one before it",
                      CheckpointWarning, stacklevel=2)
    return None


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped."""


def _complete_newest_first(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``: the one ``latest`` names first, then by step, newest first."""
    complete = sorted((p for p in root.glob("step-*") if (p / STATE).exists()), reverse=True) if root.is_dir() else []
    pointer = root / LATEST
    named = root / pointer.read_text().strip() if pointer.exists() else None
    return ([named] if named in complete else []) + [p for p in complete if p != named]


def latest_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint under a run folder, or ``path`` itself if it is one."""
    if (path / STATE).exists():
        return path
    return next(iter(_complete_newest_first(path / CHECKPOINTS)), None)


def read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint folder's ``state.json``: the run's config and progress."""
    return json.loads((checkpoint / STATE).read_text())


def load_checkpoint(
    checkpoint: Path, model: TrainableLM, optimizer: torch.optim.Optimizer | None, rank: int, world_size: int,
) -> dict[str, Any]:
    """Load this rank's part of the checkpoint into ``model`` (and ``optimizer``); return its state."""
    if (checkpoint / METADATA).exists():
        keys = saved_keys(checkpoint) if optimizer is not None else None
        state = model_and_optimizer_state(model, optimizer, True, primary_only=False, optimizer_keys=keys)
        load_sharded(checkpoint, state)
        if optimizer is not None:
            install_optimizer_state(model, optimizer, state)
    elif (checkpoint / LEGACY_MODEL).exists():
        _load_single_file(checkpoint, model, optimizer, rank, world_size)
    else:
        raise FileNotFoundError(
            f"{checkpoint} is not a moeflow checkpoint: it has neither {METADATA} nor {LEGACY_MODEL}"
        )
    return read_state(checkpoint)


def _load_single_file(
    checkpoint: Path, model: TrainableLM, optimizer: torch.optim.Optimizer | None, rank: int, world_size: int,
) -> None:
    """The earlier format: full tensors in ``model.safetensors`` and ``optimizer.safetensors``."""
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    model_state = load_file(str(checkpoint / LEGACY_MODEL))
    placed = model.placed_parameters()
    model.load_state_dict(_shard(model_state, placed, rank, world_size), strict=True)
    if optimizer is not None:
        saved = load_file(str(checkpoint / "optimizer.safetensors"))
        moments = {f"{n}.{m}": where for n, where in placed.items() for m in MOMENTS}
        sharded = _shard(saved, moments, rank, world_size)
        for name, parameter in model.named_parameters():
            if f"{name}.step" not in sharded:
                continue
            optimizer.state[parameter] = {
                "step": sharded[f"{name}.step"].reshape(()).clone(),
                **{moment: sharded[f"{name}.{moment}"].to(device) for moment in MOMENTS},
            }


def _shard(
    state: dict[str, torch.Tensor], placed: dict[str, PlacedParameter], rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Slice the expert entries for ``rank``'s part of each one's placement."""
    sliced = dict(state)
    try:
        for name, (placement, kind) in placed.items():
            if name in state:
                sliced[name] = placement.shard_tensor(kind, state[name], rank)
    except ValueError as error:
        raise ValueError(f"cannot load this checkpoint on {world_size} workers: {error}") from None
    return sliced


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
