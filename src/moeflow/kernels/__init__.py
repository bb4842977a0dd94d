"""Kernel backends: which implementation runs encode/decode and the ragged grouped GEMM.

The pure-torch kernels (``moeflow.kernels.slot_gather``, ``moeflow.kernels.ragged``) are the reference and run
everywhere. The Triton kernels are an optional dependency, imported only when chosen, so the core
import stays light. Under ``TRITON_INTERPRET=1`` (set by the caller before Triton is imported)
they also run on CPU tensors, which is how CI tests them against the torch path.
"""

from __future__ import annotations

import importlib.util

import torch

from moeflow.config import KERNEL_BACKENDS


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """The one backend of a setting: ``torch`` or ``triton`` (``auto`` where nothing is measured:
    torch's; on CUDA :class:`moeflow.kernels.choice.KernelTable` measures each kernel); an unknown or
    unusable choice raises."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend={backend!r} is unknown; choose one of {', '.join(KERNEL_BACKENDS)}")
    if backend == "auto":
        return "torch"
    if backend == "triton" and not triton_installed():
        raise ValueError(
            "kernel_backend='triton' needs the optional dependency triton: pip install 'moeflow[triton]' "
            "(on a CPU, run it under TRITON_INTERPRET=1), or use kernel_backend='torch'"
        )
    return backend
