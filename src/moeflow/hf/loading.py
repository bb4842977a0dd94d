"""Load a local transformers directory (config + safetensors; never the network) onto moeflow."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeflow.hf.blocks import Group, replace_moe_blocks
from moeflow.hf.families import family_for_model_type
from moeflow.hf.lazy import load_lazily
from moeflow.hf.safetensors_files import INDEX, SINGLE, has_safetensors
from moeflow.kernels.precision import DTYPES


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - the hf extra is installed by make
        raise ImportError("moeflow.hf needs transformers: pip install 'moeflow[hf]'") from error
    return transformers


def check_model_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a transformers model directory (no config.json); pass a folder written by "
            "save_pretrained (moeflow never downloads)"
        )
    return directory


def load_hf_model(path: str | Path, dtype: str | None = None, group: Group = None, **layer_options: Any) -> nn.Module:
    """The causal LM in ``path`` with its MoE blocks on moeflow (experts spread over ``group``).

    From safetensors, each rank reads the non-expert weights and only its own experts, never
    building the whole model (:mod:`moeflow.hf.lazy`); a directory of ``pytorch_model.bin`` files
    cannot be read in parts, and is loaded whole by transformers first (with a warning)."""
    transformers = _require_transformers()
    directory = check_model_dir(path)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    family_for_model_type(config.model_type)  # an unsupported architecture fails before loading weights
    if has_safetensors(directory):
        return load_lazily(transformers, directory, config, load_dtype(dtype) if dtype else None, group,
                           **layer_options)
    warnings.warn(
        f"{directory} has no safetensors weights ({SINGLE} or {INDEX}): every worker loads the whole model "
        "with transformers before keeping its experts; save it with save_pretrained (safetensors) to load "
        "only each worker's experts", stacklevel=2,
    )
    return load_whole(transformers, directory, dtype, group, **layer_options)


def load_whole(transformers: Any, directory: Path, dtype: str | None, group: Group, **layer_options: Any) -> nn.Module:
    """transformers' ``from_pretrained`` of the whole model, then its blocks replaced: the reference
    the lazy loader matches, and the path for checkpoints it cannot read in parts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=load_dtype(dtype) if dtype else "auto",
    )
    return replace_moe_blocks(model.eval(), group, **layer_options)


def load_dtype(name: str) -> torch.dtype:
    """The dtype named ``name``: moeflow's (fp32, bf16, fp16) or torch's own (float32, float64,
    bfloat16, float16), the spelling transformers checkpoints use."""
    dtype = DTYPES.get(name, getattr(torch, name, None))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or torch's float32, float64, bfloat16, float16; "
                         f"got {name!r}")
    return dtype


def load_hf_tokenizer(path: str | Path) -> Any | None:
    """The directory's tokenizer, or None when it has none."""
    transformers = _require_transformers()
    directory = check_model_dir(path)
    if not any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


def special_tokens(model: nn.Module, tokenizer: Any | None) -> tuple[list[int], int]:
    """(EOS ids, pad id) from the generation config, the model config or the tokenizer."""
    sources = [getattr(model, "generation_config", None), model.config, tokenizer]
    eos: list[int] = []
    pad: int | None = None
    for source in sources:
        if source is None:
            continue
        value = getattr(source, "eos_token_id", None)
        if not eos and value is not None:
            eos = [value] if isinstance(value, int) else list(value)
        if pad is None and getattr(source, "pad_token_id", None) is not None:
            pad = int(source.pad_token_id)
    return eos, pad if pad is not None else (eos[0] if eos else 0)
