"""The tensors of a transformers directory's safetensors files, read lazily, slice by slice.

``safe_open`` maps a file and touches only the tensors, or the slices of a tensor (``get_slice``),
that are asked for: a worker that holds a few experts of a layer reads those and never the others.
The pages it touched stay resident (counted in the process's memory) until the file is closed, so
the files are closed every ``RELEASE_BYTES`` read and reopened on the next read. Both forms
transformers writes are read: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
RELEASE_BYTES = 16 * 2**20
Index = tuple[int | slice, ...]
"""A slice of a tensor, one entry per leading axis (an int drops that axis)."""

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def has_safetensors(directory: Path) -> bool:
    """Whether ``directory`` holds its weights as safetensors (else, e.g., ``pytorch_model.bin``)."""
    return (directory / INDEX).is_file() or (directory / SINGLE).is_file()


class SafetensorsCheckpoint:
    """The tensors of one checkpoint by name; files are opened on first use and closed on exit."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self.directory = directory
        self.files = _weight_map(directory, safe_open)
        self._handles: dict[str, Any] = {}
        self._stack = ExitStack()
        self._unreleased = 0

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()
        self._unreleased = 0

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        """Tensor ``key``, or only its ``index`` slice (the rest of the tensor is never read)."""
        handle = self._handle(key)
        value = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        self._unreleased += value.numel() * value.element_size()
        if self._unreleased >= RELEASE_BYTES:  # a tensor still mapped keeps its pages until it is freed
            self.close()
        return value

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def first_float_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating-point tensor (what transformers' ``dtype="auto"`` falls
        back to when the config names none)."""
        for key in self.files:
            dtype = _DTYPES.get(self._handle(key).get_slice(key).get_dtype())
            if dtype is not None:
                return dtype
        return None

    def _handle(self, key: str) -> Any:
        name = self.files[key]
        if name not in self._handles:
            handle = self._open(str(self.directory / name), framework="pt", device="cpu")
            self._handles[name] = self._stack.enter_context(handle)
        return self._handles[name]


def _weight_map(directory: Path, safe_open: Any) -> dict[str, str]:
    """Tensor name -> file name, from the shard index or the single file's header."""
    index = directory / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / SINGLE
    if not single.is_file():
        raise FileNotFoundError(f"{directory} has neither {INDEX} nor {SINGLE}")
    with safe_open(str(single), framework="pt", device="cpu") as handle:
        return dict.fromkeys(handle.keys(), SINGLE)
