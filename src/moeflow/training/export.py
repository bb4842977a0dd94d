"""A moeflow checkpoint's model as safetensors shards, one layer at a time.

``moeflow export`` of a run of moeflow's own model: the model's tensors under their state-dict
names, the experts as full (E, ...) tensors assembled from every rank's chunks, one safetensors
file per block (and one for the rest) and the index that transformers' loaders read
(``model.safetensors.index.json``). The peak is about one block, and no worker runs.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from moeflow.progress import Progress, Quiet
from moeflow.training.sharded_checkpoint import MODEL, read_full_tensors, saved_tensors

INDEX = "model.safetensors.index.json"
"""transformers' index of a sharded safetensors checkpoint."""


def export_model(checkpoint: Path, destination: Path, progress: Progress | None = None) -> Path:
    """Write ``destination`` (a temporary folder renamed into place) from a sharded checkpoint;
    ``progress`` counts the shards written."""
    groups = layer_groups([key[len(MODEL):] for key in saved_tensors(checkpoint) if key.startswith(MODEL)])

    def tensors_of(names: list[str]) -> dict[str, torch.Tensor]:
        read = read_full_tensors(checkpoint, [MODEL + name for name in names])
        return {name[len(MODEL):]: tensor for name, tensor in read.items()}

    def beside(directory: Path) -> None:
        for name in ("state.json", "tokenizer.json"):
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, directory / name)

    return write_shards(destination, groups, tensors_of, beside, progress)


def write_shards(
    destination: Path, groups: list[list[str]], tensors_of: Callable[[list[str]], dict[str, torch.Tensor]],
    beside: Callable[[Path], None], progress: Progress | None = None,
) -> Path:
    """One safetensors shard per group of names (``tensors_of`` reads a group's tensors: only one
    group is held at a time), transformers' index, and what ``beside`` adds; written into a
    temporary folder renamed into place, so a failed export leaves no partial ``destination``.
    ``progress`` counts the shards: a large model's export takes minutes."""
    from safetensors.torch import save_file

    progress = progress or Quiet()
    progress.expect(len(groups))

    temporary = destination.with_name(destination.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for number, names in enumerate(groups, 1):
        tensors = {name: tensor.contiguous() for name, tensor in tensors_of(names).items()}
        shard = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(temporary / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors  # before the next group is read: one group in memory at a time
        progress.advance()
    write_index(temporary, weight_map, total)
    beside(temporary)
    shutil.rmtree(destination, ignore_errors=True)
    temporary.rename(destination)
    return destination


def layer_groups(names: list[str]) -> list[list[str]]:
    """``names`` grouped by layer (the first number in a name), the rest (embeddings, final norm,
    head) last: one safetensors shard each."""
    by_layer: dict[int, list[str]] = {}
    for name in names:
        number = re.search(r"\.(\d+)\.", f".{name}")
        by_layer.setdefault(int(number.group(1)) if number else -1, []).append(name)
    return [by_layer[key] for key in sorted(by_layer, key=lambda n: (n < 0, n))]


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    """transformers' index of a sharded safetensors checkpoint: the shard of every tensor."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
