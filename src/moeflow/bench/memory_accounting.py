"""What a worker process holds, for ``moeflow bench memory``: its peak resident memory (VmHWM), a
baseline process's, the parameters it must hold (from each MoE layer's placement), the bytes a
forward saves for the backward, and one JSON record per worker. The scenarios' modules
(:mod:`moeflow.bench.memory`, :mod:`moeflow.bench.memory_layouts`) measure with these."""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

SCENARIOS = ("generation", "scheduled-generation", "training", "sharded-experts", "whole-experts")
"""What ``moeflow bench memory`` measures; the last two are :mod:`moeflow.bench.memory_layouts`' (a
user's loop on a (dp, ep) mesh), the others :mod:`moeflow.bench.memory`'s."""
TRAINING_BYTES_PER_PARAMETER = 16
"""What training holds per local parameter, as issue 40 counts it: the fp32 weight, its gradient and
AdamW's two moments."""
BASELINE_SCRIPT = """
import importlib.util
import torch
import moeflow
if importlib.util.find_spec("transformers") is not None:
    import transformers
from moeflow.bench.memory_accounting import peak_rss_bytes
print(peak_rss_bytes())
"""
"""The import-only process: what every worker holds before it does anything."""
IMPORTS_SCRIPT = """
import importlib, json, sys
for name in json.load(sys.stdin):
    try:
        importlib.import_module(name)
    except (Exception, SystemExit):  # a module that imports only from another, or not here
        pass
from moeflow.bench.memory_accounting import peak_rss_bytes
print(peak_rss_bytes())
"""
"""The process that imports what a worker had loaded (module names on stdin): its code alone."""


@dataclass(frozen=True)
class MemoryBenchConfig:
    """The model's shape and the runs' lengths (``steps`` before the checkpoint, and again after
    the resume); ``data`` and ``vocab_size`` are the training corpus (None: the trainer's default)."""

    scenarios: tuple[str, ...] = SCENARIOS
    workers: tuple[int, ...] = (1, 2, 4)
    layers: int = 4
    model_dim: int = 512
    hidden_dim: int = 2048
    num_experts: int = 8
    top_k: int = 2
    steps: int = 3
    data: str | None = None
    vocab_size: int = 4096
    imports: bool = True  # also measure the process that imports what the workers loaded


# -- what a process holds ---------------------------------------------------------------------------


def ru_maxrss_bytes() -> int:
    """``getrusage``'s peak of this process (kilobytes on Linux, bytes on macOS)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value) if sys.platform == "darwin" else int(value) * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM on Linux (its own, not its parent's at the
    fork), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return ru_maxrss_bytes()


def cuda_peak_allocated_bytes() -> int | None:
    """The CUDA allocator's peak where this process used CUDA, else None."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.max_memory_allocated())


def _script_peak(script: str, stdin: str = "") -> int:
    """The peak of a fresh Python process running ``script`` (which prints it)."""
    done = subprocess.run([sys.executable, "-c", script], input=stdin, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the measuring process failed:\n{done.stderr[-2000:]}")
    return int(done.stdout.split()[-1])


def baseline_bytes() -> int:
    """The peak of a fresh process that only imports torch, transformers (if installed) and moeflow."""
    return _script_peak(BASELINE_SCRIPT)


def imports_bytes(modules: list[str]) -> int:
    """The peak of a fresh process that imports ``modules`` in order: a worker's code alone."""
    return _script_peak(IMPORTS_SCRIPT, json.dumps(modules))


def loaded_modules() -> list[str]:
    """The modules this process has loaded, in load order (not the ``__main__`` ones)."""
    return [name for name in sys.modules if not name.startswith("__")]


def worker_peaks() -> dict[str, Any]:
    """What a worker reports once the library has returned: its peaks and its loaded modules."""
    return {"peak_bytes": peak_rss_bytes(), "ru_maxrss_bytes": ru_maxrss_bytes(),
            "cuda_peak_allocated_bytes": cuda_peak_allocated_bytes(), "modules": loaded_modules()}


@dataclass(frozen=True)
class HeldParameters:
    """A worker's parameters as the library placed them: what it must hold (local counts)."""

    parameters: int
    non_expert_bytes: int
    expert_bytes: int  # this rank's shards of every layer's experts
    model_bytes: int  # the whole model: the non-expert parameters and every expert
    local_experts: tuple[int, ...]  # per MoE layer, from its placement
    num_experts: int

    @property
    def bytes(self) -> int:
        return self.non_expert_bytes + self.expert_bytes


def _expert_numel(placement: Any, kind: str, local: torch.Tensor, rank: int | None) -> int:
    """Elements of expert parameter ``kind`` that ``rank``'s shards of the placement cover (None:
    every expert, the full (E, ...) tensor); ``local`` gives the dimensions no placement splits."""
    from moeflow.parallel.placement import HIDDEN_AXIS

    axis = HIDDEN_AXIS.get(kind)
    whole = math.prod(placement.full_shape(kind, local)) // placement.num_experts  # one whole expert
    if rank is None:
        return placement.num_experts * whole
    widths = [shard.hidden_stop - shard.hidden_start for shard in placement.local(rank)]
    return sum(whole * width // placement.hidden_dim if axis is not None else whole for width in widths)


def held_parameters(model: nn.Module) -> HeldParameters:
    """Count ``model``'s local parameters: the non-expert ones as they are, the experts as each MoE
    layer's placement gives this rank (what it must hold, whatever its tensors hold)."""
    from moeflow.moe.layer import MoELayer

    layers = [module for module in model.modules() if isinstance(module, MoELayer)]
    experts = {id(p): (layer, kind, p) for layer in layers for kind, p in layer.experts.named_parameters()}
    others = [p for p in model.parameters() if id(p) not in experts]
    mine = [(_expert_numel(layer.placement, kind, p, layer.rank), p.element_size()) for layer, kind, p in
            experts.values()]
    every = sum(_expert_numel(layer.placement, kind, p, None) * p.element_size() for layer, kind, p in
                experts.values())
    non_expert = sum(p.numel() * p.element_size() for p in others)
    return HeldParameters(
        parameters=sum(p.numel() for p in others) + sum(numel for numel, _ in mine), non_expert_bytes=non_expert,
        expert_bytes=sum(numel * size for numel, size in mine), model_bytes=non_expert + every,
        local_experts=tuple(layer.placement.num_local(layer.rank) for layer in layers),
        num_experts=layers[0].placement.num_experts if layers else 0,
    )


Measured = tuple[list[dict[str, Any]], list[str]]
"""A measurement's records (one per worker) and the modules its workers loaded."""


def union_of(lists: Iterable[list[str]]) -> list[str]:
    """The names of every list, each once, in first-seen order."""
    return list(dict.fromkeys(name for names in lists for name in names))


def worker_record(scenario: str, workers: int, rank: int, result: dict[str, Any], baseline: int, share: int,
            held: HeldParameters, **extra: Any) -> dict[str, Any]:
    """One worker's JSON record: peak, baseline, share and their ratio, and what the share is made of."""
    above = result["peak_bytes"] - baseline
    return {
        "bench": "memory", "scenario": scenario, "workers": workers, "rank": rank,
        "peak_bytes": result["peak_bytes"], "baseline_bytes": baseline, "above_baseline_bytes": above,
        "share_bytes": share, "ratio": above / share, "parameters": held.parameters,
        "non_expert_bytes": held.non_expert_bytes, "expert_bytes": held.expert_bytes, "model_bytes": held.model_bytes,
        "local_experts": list(held.local_experts), "num_experts": held.num_experts, **extra,
        "ru_maxrss_bytes": result["ru_maxrss_bytes"], "cuda_peak_allocated_bytes": result["cuda_peak_allocated_bytes"],
    }


def saved_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes that ``forward`` (a training forward of ``model``) saves for the backward, counted with
    saved-tensor hooks, each storage once, ``model``'s parameters left out."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(saved.values())
