"""``moeflow bench memory``: how much memory each worker holds beyond what it must.

Per worker: its peak resident memory minus that of a process that only imports torch, transformers
and moeflow (the baseline), over its share, the bytes the worker must hold: the non-expert
parameters plus this rank's experts (read from each MoE layer's placement), and in training 16
bytes per such parameter (fp32 weight, gradient, AdamW's two moments) plus the activations one
training batch's forward keeps for the backward. A ratio near 1 means memory scales with workers.

Three scenarios, each through the library's own code paths in gloo workers spawned as the commands
spawn them: ``generation`` runs ``moeflow generate --hf``'s worker function on a random Mixtral-like
model saved with ``save_pretrained``; ``scheduled-generation`` the same with Lina's per-batch
placement (``--schedule oracle``: a worker fetches the experts it computes but does not store, and
drops them after the forward); ``training`` runs the trainer's worker for ``steps`` steps
(saving a checkpoint), then resumes from that checkpoint for ``steps`` more (saving again). Each
worker reads its peak when the library has returned; only then does it build the model again
(with the same library functions) to read its placement and count its share, so the counting
never shows in the peak.

Part of every peak is code, not data: importing transformers' model class, or the modules a
training step loads (``torch._dynamo``, ``sympy``, ``triton``), adds some 200 MB that no model size
changes. So the records also give ``imports_bytes``, the peak of a process that imports every module
the scenario's worker had loaded, and the ratio above that.

Why VmHWM and not ``ru_maxrss`` on Linux: a spawned worker is forked, then runs a new program, and
Linux carries the parent's resident size at the fork into the child's ``ru_maxrss``; a driver that
holds a model would inflate every worker's figure. ``VmHWM`` is the high-water mark of the
process's own memory since its program started. Elsewhere ``ru_maxrss`` is used.
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeflow.files import print_json

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moeflow.training.config import TrainConfig
    from moeflow.training.trainer import Job

SCENARIOS = ("generation", "scheduled-generation", "training")
TRAINING_BYTES_PER_PARAMETER = 16
"""What training holds per local parameter, as issue 40 counts it: the fp32 weight, its gradient and
AdamW's two moments."""
RATIO_TARGET = 1.5
"""Issue 40's target: (peak - baseline) / share at most this at 2 workers and more."""
HEADS = 4
"""Attention heads of both scenarios' models (the trainer's default)."""
VOCAB = 1024
"""The generation model's vocabulary (issue 40's model: 0.42 GB in fp32, 95 % of it experts)."""
PROMPTS, PROMPT_TOKENS, NEW_TOKENS, BATCH_SIZE = 8, 16, 8, 8
"""Generation: 8 prompts of 16 random tokens shared among the workers, 8 new tokens each, batches of
8 (``moeflow generate``'s default batch size)."""
BASELINE_SCRIPT = """
import importlib.util
import torch
import moeflow
if importlib.util.find_spec("transformers") is not None:
    import transformers
from moeflow.bench.memory import peak_rss_bytes
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
from moeflow.bench.memory import peak_rss_bytes
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


def _worker_peaks() -> dict[str, Any]:
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


def _union(lists: Iterable[list[str]]) -> list[str]:
    """The names of every list, each once, in first-seen order."""
    return list(dict.fromkeys(name for names in lists for name in names))


def _record(scenario: str, workers: int, rank: int, result: dict[str, Any], baseline: int, share: int,
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


# -- generation -------------------------------------------------------------------------------------


def save_generation_model(config: MemoryBenchConfig, directory: Path) -> None:
    """A random-weight Mixtral-like model of the configured shape, saved with ``save_pretrained``."""
    from moeflow.bench.generate import ModelShape, random_model, swiglu_dims

    dims = swiglu_dims(config.model_dim, config.hidden_dim, config.num_experts, config.top_k)
    shape = ModelShape("mixtral-like", "mixtral", dims, layers=config.layers, heads=HEADS, kv_heads=HEADS, vocab=VOCAB)
    random_model(shape, "eager").save_pretrained(directory)


def _prompt_ids() -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, VOCAB, (PROMPTS, PROMPT_TOKENS), generator=generator).tolist()


def is_generation(scenario: str) -> bool:
    return scenario.endswith("generation")


def _generation_worker(rank: int, world_size: int, path: str, prompt_ids: list[list[int]],
                       settings: Any, schedule: Any) -> dict[str, Any]:
    """``moeflow generate --hf``'s own worker function, then this process's peak; then the model
    loaded again by the same loader, for its placement (after the peak is read)."""
    import torch.distributed as dist

    from moeflow.hf.loading import load_hf_model
    from moeflow.hf.serving import generate_worker

    generate_worker(rank, world_size, path, prompt_ids, BATCH_SIZE, None, settings, schedule)
    result = _worker_peaks()
    result["held"] = held_parameters(load_hf_model(path, None, dist.group.WORLD if world_size > 1 else None))
    return result


def measure_generation(model_dir: Path, workers: int, baseline: int, scenario: str = "generation") -> Measured:
    """One record per worker of generation with ``workers`` gloo workers, and the modules they
    loaded; ``scheduled-generation`` places the experts per batch as ``--schedule oracle`` does
    (Lina's scheduling with the gate's own counts as the estimate: no routing profile to make)."""
    from moeflow.distributed import run_distributed
    from moeflow.hf.generate import SamplingSettings
    from moeflow.hf.serving import ScheduleRequest
    from moeflow.inference import SchedulerSettings

    settings = SamplingSettings(max_new_tokens=NEW_TOKENS)
    schedule = ScheduleRequest(SchedulerSettings("oracle")) if scenario == "scheduled-generation" else None
    results = run_distributed(_generation_worker, workers, str(model_dir), _prompt_ids(), settings, schedule,
                              timeout_s=3600.0)
    records = [_record(scenario, workers, rank, result, baseline, result["held"].bytes, result["held"])
               for rank, result in enumerate(results)]
    return records, _union(result["modules"] for result in results)


# -- training ---------------------------------------------------------------------------------------


def activation_bytes(model: nn.Module, config: TrainConfig, vocab_size: int, device: torch.device) -> int:
    """Bytes that one training batch's forward keeps for the backward, parameters left out: the
    activations, counted on the model's real forward with saved-tensor hooks (a collective)."""
    import torch

    from moeflow.training.evaluation import autocast

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab_size, (config.batch_size, config.context + 1), generator=generator).to(device)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast(config, device):
        model(tokens[:, :-1], tokens[:, 1:])
    return sum(saved.values())


def _training_share(rank: int, world_size: int, job: Job) -> tuple[HeldParameters, int]:
    """The model built as the trainer builds it: its local parameters and one batch's activations."""
    import torch.distributed as dist

    from moeflow.comm.groups import ParallelGroups
    from moeflow.comm.topology import Topology
    from moeflow.training.trainer import build_model, device_for

    config = job.config
    device = device_for(config, rank if job.local_rank is None else job.local_rank)
    group = dist.group.WORLD if dist.is_initialized() else None
    groups = ParallelGroups.from_group(group, Topology(world_size, job.ranks_per_node or world_size))
    model = build_model(config, job.corpus, groups, device)
    try:
        return held_parameters(model), activation_bytes(model, config, job.corpus.vocab_size, device)
    finally:
        model.groups.worker.shutdown()


def _training_worker(rank: int, world_size: int, job: Job, count_share: bool) -> dict[str, Any]:
    """The trainer's own worker, then this process's peak; with ``count_share``, then the share."""
    from moeflow.training.trainer import train_worker

    train_worker(rank, world_size, job)
    result = _worker_peaks()
    if count_share:
        result["held"], result["activation_bytes"] = _training_share(rank, world_size, job)
    return result


def training_config(config: MemoryBenchConfig, workers: int, run_dir: Path) -> TrainConfig:
    """``moeflow train`` of the configured shape: ``steps`` steps, then a checkpoint (``stop_at``);
    the resume runs to twice that."""
    from moeflow.training.config import TrainConfig

    return TrainConfig(
        data=config.data, vocab_size=config.vocab_size, layers=config.layers, heads=HEADS,
        model_dim=config.model_dim, hidden_dim=config.hidden_dim, num_experts=config.num_experts,
        top_k=config.top_k, steps=2 * config.steps, stop_at=config.steps, workers=workers,
        run_dir=str(run_dir), progress=False,
    )


def _run_training_workers(job: Job, count_share: bool) -> list[dict[str, Any]]:
    """The workers of a training run, spawned as ``moeflow train`` spawns them."""
    from moeflow.distributed import run_distributed

    config = job.config
    return run_distributed(_training_worker, config.workers, job, count_share,
                           threads_per_worker=config.threads_per_worker, timeout_s=float("inf"),
                           collective_timeout_s=config.collective_timeout_s)


def measure_training(config: MemoryBenchConfig, workers: int, baseline: int, run_dir: Path) -> Measured:
    """One record per worker of a training run that saves a checkpoint and one that resumes from
    it (fresh processes each): the higher of its two peaks against its share."""
    from moeflow.training.launch import prepare_job, resume_config

    saved = _run_training_workers(prepare_job(training_config(config, workers, run_dir)), count_share=False)
    resumed_config, checkpoint = resume_config(str(run_dir), {})
    resumed = _run_training_workers(prepare_job(resumed_config, checkpoint), count_share=True)
    records = []
    for rank, (first, second) in enumerate(zip(saved, resumed, strict=True)):
        held: HeldParameters = second["held"]
        state = TRAINING_BYTES_PER_PARAMETER * held.parameters
        peak = max(first, second, key=lambda result: result["peak_bytes"])
        records.append(_record(
            "training", workers, rank, peak, baseline, state + second["activation_bytes"], held,
            state_bytes=state, activation_bytes=second["activation_bytes"], peak_save_bytes=first["peak_bytes"],
            peak_resume_bytes=second["peak_bytes"], steps=config.steps, checkpoint=checkpoint.name,
        ))
    return records, _union(result["modules"] for result in [*saved, *resumed])


# -- the benchmark ----------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], baseline: int) -> dict[str, Any]:
    """The worst worker's ratios per scenario and worker count, and issue 40's targets (every
    worker's ratio at most 1.5 at 2 workers and more)."""
    worst: dict[str, dict[str, float]] = {}
    after_imports: dict[str, dict[str, float]] = {}
    imports: dict[str, float] = {}
    for record in records:
        key, scenario = str(record["workers"]), record["scenario"]
        by_workers = worst.setdefault(scenario, {})
        by_workers[key] = round(max(by_workers.get(key, -math.inf), record["ratio"]), 3)
        if "imports_bytes" in record:
            imports[scenario] = round(record["imports_bytes"] / 1e6, 1)
            by_workers = after_imports.setdefault(scenario, {})
            by_workers[key] = round(max(by_workers.get(key, -math.inf), record["ratio_after_imports"]), 3)
    targets = []
    for scenario, by_workers in worst.items():
        ratios = [ratio for workers, ratio in by_workers.items() if int(workers) >= 2]
        if ratios:
            targets.append({"target": f"{scenario}: every worker's ratio <= {RATIO_TARGET} at 2+ workers",
                            "value": max(ratios), "met": max(ratios) <= RATIO_TARGET})
    return {"summary": "memory", "baseline_mb": round(baseline / 1e6, 1), "worst_ratio": worst,
            "imports_mb": imports, "worst_ratio_after_imports": after_imports, "targets": targets,
            "all_targets_met": all(target["met"] for target in targets)}


def _measure(config: MemoryBenchConfig, scenario: str, workers: int, baseline: int, scratch: Path) -> Measured:
    """One scenario at one worker count (a training run's folder is removed after: its checkpoints
    hold three times the model, twice)."""
    if is_generation(scenario):
        return measure_generation(scratch / "model", workers, baseline, scenario)
    run_dir = scratch / f"train-{workers}"
    try:
        return measure_training(config, workers, baseline, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _add_imports(records: list[dict[str, Any]], imports: int) -> None:
    for record in records:
        record["imports_bytes"] = imports
        record["ratio_after_imports"] = (record["peak_bytes"] - imports) / record["share_bytes"]


def run(config: MemoryBenchConfig) -> int:
    """Measure every scenario at every worker count; print each record and the summary. The
    imports process runs once per scenario, on the modules of its first worker count's workers."""
    baseline = baseline_bytes()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-memory-") as scratch:
        if any(is_generation(scenario) for scenario in config.scenarios):
            save_generation_model(config, Path(scratch) / "model")
        for scenario in config.scenarios:
            imports = None
            for workers in config.workers:
                found, modules = _measure(config, scenario, workers, baseline, Path(scratch))
                if config.imports and imports is None:
                    imports = imports_bytes(modules)
                if imports is not None:
                    _add_imports(found, imports)
                for record in found:
                    print_json(record)
                records += found
    print_json(summarize(records, baseline))
    return 0
