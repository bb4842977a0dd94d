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

import math
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeflow.bench.memory_accounting import (
    TRAINING_BYTES_PER_PARAMETER,
    HeldParameters,
    Measured,
    MemoryBenchConfig,
    baseline_bytes,
    held_parameters,
    imports_bytes,
    saved_bytes,
    union_of,
    worker_peaks,
    worker_record,
)
from moeflow.files import print_json
from moeflow.progress import Progress, Quiet

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moeflow.training.config import TrainConfig
    from moeflow.training.trainer import Job

RATIO_TARGET = 1.5
"""Issue 40's target: (peak - baseline) / share at most this at 2 workers and more."""
HEADS = 4
"""Attention heads of both scenarios' models (the trainer's default)."""
VOCAB = 1024
"""The generation model's vocabulary (issue 40's model: 0.42 GB in fp32, 95 % of it experts)."""
PROMPTS, PROMPT_TOKENS, NEW_TOKENS, BATCH_SIZE = 8, 16, 8, 8
"""Generation: 8 prompts of 16 random tokens shared among the workers, 8 new tokens each, batches of
8 (``moeflow generate``'s default batch size)."""


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
    result = worker_peaks()
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
    records = [worker_record(scenario, workers, rank, result, baseline, result["held"].bytes, result["held"])
               for rank, result in enumerate(results)]
    return records, union_of(result["modules"] for result in results)


# -- training ---------------------------------------------------------------------------------------


def activation_bytes(model: nn.Module, config: TrainConfig, vocab_size: int, device: torch.device) -> int:
    """Bytes that one training batch's forward keeps for the backward, parameters left out: the
    activations, counted on the model's real forward (a collective)."""
    import torch

    from moeflow.training.evaluation import autocast

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab_size, (config.batch_size, config.context + 1), generator=generator).to(device)
    with autocast(config, device):
        return saved_bytes(model, lambda: model(tokens[:, :-1], tokens[:, 1:]))


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
    result = worker_peaks()
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
        records.append(worker_record(
            "training", workers, rank, peak, baseline, state + second["activation_bytes"], held,
            state_bytes=state, activation_bytes=second["activation_bytes"], peak_save_bytes=first["peak_bytes"],
            peak_resume_bytes=second["peak_bytes"], steps=config.steps, checkpoint=checkpoint.name,
        ))
    return records, union_of(result["modules"] for result in [*saved, *resumed])


# -- the benchmark ----------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], baseline: int) -> dict[str, Any]:
    """The worst worker's ratios per scenario and worker count, and issue 40's targets (every
    worker's ratio at most 1.5 at 2 workers and more; not for the reference scenarios)."""
    from moeflow.bench.memory_layouts import REFERENCE_SCENARIOS

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
        if scenario in REFERENCE_SCENARIOS:
            continue
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
    from moeflow.bench.memory_layouts import LAYOUT_SCENARIOS, measure_layout

    if is_generation(scenario):
        return measure_generation(scratch / "model", workers, baseline, scenario)
    if scenario in LAYOUT_SCENARIOS:
        return measure_layout(config, scenario, workers, baseline)
    run_dir = scratch / f"train-{workers}"
    try:
        return measure_training(config, workers, baseline, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _add_imports(records: list[dict[str, Any]], imports: int) -> None:
    for record in records:
        record["imports_bytes"] = imports
        record["ratio_after_imports"] = (record["peak_bytes"] - imports) / record["share_bytes"]


def run(config: MemoryBenchConfig, progress: Progress | None = None) -> int:
    """Measure every scenario at every worker count; print each record and the summary. The
    imports process runs once per scenario, on the modules of its first worker count's workers.
    ``progress`` counts the (scenario, worker count) measurements done."""
    progress = progress or Quiet()
    progress.expect(len(config.scenarios) * len(config.workers))
    baseline = baseline_bytes()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-memory-") as scratch:
        if any(is_generation(scenario) for scenario in config.scenarios):
            save_generation_model(config, Path(scratch) / "model")
        for scenario in config.scenarios:
            imports = None
            for workers in config.workers:
                progress.note(f"{scenario}, workers {workers}")
                found, modules = _measure(config, scenario, workers, baseline, Path(scratch))
                if config.imports and imports is None:
                    imports = imports_bytes(modules)
                if imports is not None:
                    _add_imports(found, imports)
                for record in found:
                    print_json(record)
                records += found
                progress.advance()
    print_json(summarize(records, baseline))
    return 0
