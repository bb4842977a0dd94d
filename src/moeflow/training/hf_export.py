"""A transformers directory from a sharded ``train --hf`` checkpoint, one decoder layer at a time.

The model is built on the meta device from the source's config (no memory). For each decoder
layer, its tensors are read from the checkpoint (:func:`~moeflow.training.sharded_checkpoint.read_full_tensors`:
every rank's chunks of the layer's experts assembled), its MoE block is materialised alone and
filled in transformers' layout (:func:`~moeflow.hf.weights.write_hf_block`), and the layer is
written as one safetensors shard; an index names the shard of every tensor, as ``save_pretrained``
writes for sharded checkpoints. The peak is about one layer, not the model, and no worker gathers
another's experts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from moeflow.hf.families import family_of
from moeflow.hf.lazy import _empty_model
from moeflow.hf.weights import write_hf_block
from moeflow.progress import Progress
from moeflow.training.export import layer_groups, write_shards
from moeflow.training.sharded_checkpoint import MODEL, read_full_tensors, saved_tensors

HF_MODEL = MODEL + "model."
"""The prefix of the transformers model's tensors in a ``train --hf`` checkpoint (the trainer's
``HFCausalLM.model``)."""
HF_CONFIG_FILES = ("config.json", "generation_config.json")
"""What a ``train --hf`` checkpoint copies from the source so that it exports on its own."""


def export_hf(checkpoint: Path, destination: Path, tokenizer_source: Path | None = None,
              progress: Progress | None = None) -> Path:
    """Write ``destination`` (atomically: a temporary folder renamed) from ``checkpoint``, a
    sharded checkpoint of a ``train --hf`` run holding the source's ``config.json``; the tokenizer
    files are copied from ``tokenizer_source`` when given; ``progress`` counts the layers written."""
    import transformers

    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} holds no config.json: it is not a checkpoint of a train --hf run")
    config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    saved = saved_tensors(checkpoint)
    dtype = next(md.properties.dtype for key, md in saved.items() if key.startswith(HF_MODEL))
    config.dtype = dtype
    model = _empty_model(transformers, config, dtype)

    def beside(directory: Path) -> None:
        config.save_pretrained(directory)
        _copy_beside(checkpoint, tokenizer_source, directory)

    keys = list(saved)
    return write_shards(destination, layer_groups(_saved_names(model)),
                        lambda names: _layer_tensors(checkpoint, keys, model, names), beside, progress)


def _saved_names(model: nn.Module) -> list[str]:
    """The model's tensor names that ``save_pretrained`` writes: a tied tensor once."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


def _layer_tensors(checkpoint: Path, saved: list[str], model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of one layer in transformers' names and layout."""
    blocks = {prefix: module for prefix, module in model.named_modules() if family_of(module) is not None
              and any(name.startswith(prefix + ".") for name in names)}
    in_block = {name for name in names for prefix in blocks if name.startswith(prefix + ".")}
    plain = [name for name in names if name not in in_block]
    tensors = {name: tensor for name, tensor in zip(
        plain, read_full_tensors(checkpoint, [HF_MODEL + name for name in plain]).values(), strict=True)}
    for prefix, block in blocks.items():
        tensors |= {f"{prefix}.{name}": t for name, t in _block_tensors(checkpoint, saved, prefix, block).items()}
    return tensors


def _block_tensors(checkpoint: Path, saved: list[str], prefix: str, block: nn.Module) -> dict[str, torch.Tensor]:
    """One MoE block's tensors in transformers' layout, from the moeflow layer's full state
    (``saved``: the checkpoint's keys)."""
    family = family_of(block)
    assert family is not None
    stem = f"{HF_MODEL}{prefix}.moe."
    keys = [key for key in saved if key.startswith(stem)]
    if not keys:
        raise ValueError(f"{checkpoint} holds no moeflow layer for {prefix}: it was saved from another model")
    state = {key[len(stem):]: tensor for key, tensor in read_full_tensors(checkpoint, keys).items()}
    materialized = _copy_on_cpu(block)
    write_hf_block(materialized, family, state)
    return {name: tensor.detach() for name, tensor in materialized.state_dict().items()}


def _copy_on_cpu(block: nn.Module) -> nn.Module:
    """An uninitialised copy of a meta block on the CPU (the meta model stays as it is)."""
    import copy

    return copy.deepcopy(block).to_empty(device="cpu")


def _copy_beside(checkpoint: Path, tokenizer_source: Path | None, destination: Path) -> None:
    """The generation config, and the tokenizer files of the source model."""
    if (checkpoint / "generation_config.json").is_file():
        shutil.copy2(checkpoint / "generation_config.json", destination / "generation_config.json")
    if tokenizer_source is None or not tokenizer_source.is_dir():
        return
    for file in tokenizer_source.iterdir():
        if file.is_file() and (file.name.startswith(("tokenizer", "special_tokens")) or file.suffix == ".model"):
            shutil.copy2(file, destination / file.name)


def hf_checkpoint_files(source: str | Path) -> list[Path]:
    """The source's files a ``train --hf`` checkpoint keeps beside the tensors."""
    return [Path(source) / name for name in HF_CONFIG_FILES if (Path(source) / name).is_file()]
