"""Checkpoints in safetensors, independent of the number of workers, written atomically.

A checkpoint is a folder ``checkpoints/step-NNNNNN`` holding ``model.safetensors`` (every
parameter, experts gathered to their full (E, ...) shape), ``optimizer.safetensors`` (AdamW's
moments in the same layout), ``state.json`` (step, counters, the config) and the tokenizer, so it
is self-contained. Every rank takes part in the gather; rank 0 writes into a temporary folder,
syncs it and renames it into place, then points ``checkpoints/latest`` at it, so a crash at any
moment leaves the previous checkpoint whole. Loading slices the experts for each layer's
:class:`~moeflow.parallel.ExpertPlacement` in the loading run: a checkpoint from W workers loads into
any placement that fits (expert parallel on any W' that divides E, replicated on any W').
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeflow.files import write_atomic
from moeflow.models import TrainableLM
from moeflow.parallel.placement import PlacedParameter, gather_full

CHECKPOINTS = "checkpoints"
"""The folder of a run's checkpoints, one ``step-*`` folder each."""
LATEST = "latest"
"""The file in :data:`CHECKPOINTS` that names the newest checkpoint."""
_MOMENTS = ("exp_avg", "exp_avg_sq")


def full_state(
    model: TrainableLM, optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup | None,
    rank: int,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Model and optimizer tensors with the experts of all ranks (a collective: every rank calls it)."""
    placed = model.placed_parameters()

    def full(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in placed:
            return tensor.detach().cpu().clone()
        placement, kind = placed[name]
        return gather_full(tensor, placement, kind, rank, group).cpu()

    model_state = {name: full(name, tensor) for name, tensor in model.state_dict().items()}
    optimizer_state: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        for name, parameter in model.named_parameters():
            state = optimizer.state.get(parameter, {})
            for moment in _MOMENTS:
                if moment in state:
                    optimizer_state[f"{name}.{moment}"] = full(name, state[moment])
            if "step" in state:
                optimizer_state[f"{name}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).cpu()
    return model_state, optimizer_state


def save_checkpoint(
    run_dir: Path, step: int, model: TrainableLM, optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None, rank: int, world_size: int, state: dict[str, Any],
    extra_files: list[Path], keep: int,
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically (rank 0) and return its path on every rank."""
    from safetensors.torch import save_file

    model_state, optimizer_state = full_state(model, optimizer, group, rank)
    root = run_dir / CHECKPOINTS
    final = root / f"step-{step:06d}"
    if rank != 0:
        return final
    root.mkdir(parents=True, exist_ok=True)
    temporary = root / f".step-{step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    save_file(model_state, str(temporary / "model.safetensors"))
    save_file(optimizer_state, str(temporary / "optimizer.safetensors"))
    (temporary / "state.json").write_text(json.dumps({**state, "step": step, "world_size": world_size}, indent=2))
    for path in extra_files:
        shutil.copy2(path, temporary / path.name)
    for file in temporary.iterdir():
        _fsync(file)
    if final.exists():  # a re-run of the same step replaces it
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync(root)
    write_atomic(root / LATEST, final.name)
    _prune(root, keep)
    return final


def latest_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint under a run folder, or ``path`` itself if it is one."""
    if (path / "model.safetensors").exists():
        return path
    root = path / CHECKPOINTS
    pointer = root / LATEST
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if (candidate / "state.json").exists():
            return candidate
    complete = sorted(p for p in root.glob("step-*") if (p / "state.json").exists()) if root.is_dir() else []
    return complete[-1] if complete else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint folder's ``state.json``: the run's config and progress."""
    return json.loads((checkpoint / "state.json").read_text())


def load_checkpoint(
    checkpoint: Path, model: TrainableLM, optimizer: torch.optim.Optimizer | None, rank: int, world_size: int,
) -> dict[str, Any]:
    """Load this rank's slice of the checkpoint into ``model`` (and ``optimizer``); return its state."""
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    model_state = load_file(str(checkpoint / "model.safetensors"))
    placed = model.placed_parameters()
    model.load_state_dict(_shard(model_state, placed, rank, world_size), strict=True)
    if optimizer is not None:
        saved = load_file(str(checkpoint / "optimizer.safetensors"))
        moments = {f"{n}.{m}": where for n, where in placed.items() for m in _MOMENTS}
        sharded = _shard(saved, moments, rank, world_size)
        for name, parameter in model.named_parameters():
            if f"{name}.step" not in sharded:
                continue
            optimizer.state[parameter] = {
                "step": sharded[f"{name}.step"].reshape(()).clone(),
                **{moment: sharded[f"{name}.{moment}"].to(device) for moment in _MOMENTS},
            }
    return read_state(checkpoint)


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
