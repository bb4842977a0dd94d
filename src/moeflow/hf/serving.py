"""``moeflow generate --hf``: tokenise, share the prompts among N gloo workers, generate, collect."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moeflow.files import json_text, write_atomic
from moeflow.hf.blocks import moe_blocks
from moeflow.hf.generate import ExpertParallelGenerator, SamplingSettings
from moeflow.hf.loading import load_hf_model, load_hf_tokenizer, special_tokens
from moeflow.inference import (
    InferenceScheduler,
    RoutingProfile,
    SchedulerSettings,
    routing_fingerprint,
    schedule_layers,
)
from moeflow.inference.scheduler import summarize_records
from moeflow.metrics import MoEMonitor


@dataclass(frozen=True)
class ScheduleRequest:
    """``--schedule lina|oracle``: the scheduler's settings, (lina) the routing profile's path and
    (a replica budget's cost model) the calibrated cluster profile's."""

    settings: SchedulerSettings
    profile_path: str | None = None
    cluster_profile_path: str | None = None


def attach_schedule(model: Any, request: ScheduleRequest | None) -> InferenceScheduler | None:
    """Schedule the model's MoE blocks as asked (a collective), after checking the profile."""
    if request is None:
        return None
    layers = [block.moe for block in moe_blocks(model)]
    profile = None
    if request.profile_path is not None:
        profile = RoutingProfile.load(request.profile_path)
        profile.check_matches(len(layers), layers[0].config.num_experts,
                              routing_fingerprint([layer.gate for layer in layers]), request.profile_path)
    cost = None
    if request.cluster_profile_path is not None:
        from moeflow.perf import ClusterProfile, CostModel

        cost = CostModel(ClusterProfile.load(request.cluster_profile_path))
    scheduler = InferenceScheduler(request.settings, len(layers), profile, cost=cost)
    schedule_layers(layers, scheduler)
    return scheduler


def shares(count: int, workers: int) -> list[range]:
    """Contiguous, nearly equal slices of ``count`` prompts (a worker may get none)."""
    base, extra = divmod(count, workers)
    starts = [rank * base + min(rank, extra) for rank in range(workers + 1)]
    return [range(starts[rank], starts[rank + 1]) for rank in range(workers)]


def _progress(rank: int) -> Any:
    if rank != 0:
        return None
    return lambda line: print(f"moeflow generate: worker 0: {line}", file=sys.stderr, flush=True)


def generate_worker(
    rank: int, world_size: int, path: str, prompt_ids: list[list[int]], batch_size: int, dtype: str | None,
    settings: SamplingSettings, schedule: ScheduleRequest | None = None, health: bool = False,
) -> tuple[list[list[int]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One worker: load the model with this rank's experts, generate for its share of the prompts;
    with a schedule, also a summary of its plans per round of batches; with ``health``, the MoE
    layers' health per round (every worker's tokens: each round ends on every worker alike)."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # this worker process's own setting: one progress report, from worker 0
    group = dist.group.WORLD if world_size > 1 else None
    model = load_hf_model(path, dtype, group)
    eos, pad = special_tokens(model, None)
    scheduler = attach_schedule(model, schedule)
    mine = [prompt_ids[i] for i in shares(len(prompt_ids), world_size)[rank]]
    log: list[dict[str, Any]] = []
    monitor = MoEMonitor(model, group, warn=rank == 0, use_default_group=False) if health else None
    health_log: list[dict[str, Any]] = []

    def after_round(index: int) -> None:
        if scheduler is not None:
            log.append({"round": index, **summarize_records(scheduler.take_records())})
        if monitor is not None:  # a collective: every worker ends the round here
            health_log.append({"round": index, **monitor.observe(index).record()})

    generator = ExpertParallelGenerator(model, settings, eos, pad, group, _progress(rank), after_round)
    outputs = generator.generate(mine, batch_size)
    if monitor is not None:
        monitor.close()
    return outputs, log, health_log


def generate_hf(
    path: str, prompts: Sequence[dict[str, Any]], workers: int, batch_size: int, dtype: str | None = None,
    schedule: ScheduleRequest | None = None, health_path: str | Path | None = None, **sampling: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A record per prompt (its ids, the new ids and, with a tokenizer, the new text) and, with a
    schedule, the per-round summary of the plans (the same on every worker: worker 0's).
    ``health_path``: a JSON lines file of the MoE layers' health per round of batches."""
    settings = SamplingSettings(**sampling)
    tokenizer = load_hf_tokenizer(path)
    prompt_ids = []
    for number, prompt in enumerate(prompts, 1):
        if "input_ids" in prompt:
            prompt_ids.append([int(t) for t in prompt["input_ids"]])
        elif tokenizer is None:
            raise ValueError(f"prompt {number} is text but {path!r} has no tokenizer: give 'input_ids' instead")
        else:
            prompt_ids.append(tokenizer(prompt["prompt"])["input_ids"])
        if not prompt_ids[-1]:
            raise ValueError(f"prompt {number} has no token")
    from moeflow.distributed import run_distributed  # at the call, as the library's other spawns: light to import

    results = run_distributed(
        generate_worker, workers, path, prompt_ids, batch_size, dtype, settings, schedule, health_path is not None,
        timeout_s=24 * 3600.0,
    )
    if health_path is not None:
        write_atomic(Path(health_path), "".join(json_text(record) + "\n" for record in results[0][2]))
    outputs = [ids for worker_outputs, _, _ in results for ids in worker_outputs]
    records = []
    for index, (prompt, ids, new) in enumerate(zip(prompts, prompt_ids, outputs, strict=True)):
        record: dict[str, Any] = {"index": index, **prompt, "input_ids": ids, "output_ids": new}
        if tokenizer is not None:
            record["text"] = tokenizer.decode(new, skip_special_tokens=True)
        records.append(record)
    return records, results[0][1]
