"""``moeflow generate --hf``: tokenise, share the prompts among N gloo workers, generate, collect."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from moeflow.distributed import run_distributed
from moeflow.hf.generate import ExpertParallelGenerator, SamplingSettings
from moeflow.hf.loading import load_hf_model, load_hf_tokenizer, special_tokens


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
    settings: SamplingSettings,
) -> list[list[int]]:
    """One worker: load the model with this rank's experts, generate for its share of the prompts."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # this worker process's own setting: one progress report, from worker 0
    group = dist.group.WORLD if world_size > 1 else None
    model = load_hf_model(path, dtype, group)
    eos, pad = special_tokens(model, None)
    mine = [prompt_ids[i] for i in shares(len(prompt_ids), world_size)[rank]]
    generator = ExpertParallelGenerator(model, settings, eos, pad, group, _progress(rank))
    return generator.generate(mine, batch_size)


def generate_hf(
    path: str, prompts: Sequence[dict[str, Any]], workers: int, batch_size: int, dtype: str | None = None,
    **sampling: Any,
) -> list[dict[str, Any]]:
    """A record per prompt: its ids, the new ids and (with a tokenizer) the new text."""
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
    results = run_distributed(
        generate_worker, workers, path, prompt_ids, batch_size, dtype, settings, timeout_s=24 * 3600.0,
    )
    outputs = [ids for worker_outputs in results for ids in worker_outputs]
    records = []
    for index, (prompt, ids, new) in enumerate(zip(prompts, prompt_ids, outputs, strict=True)):
        record: dict[str, Any] = {"index": index, **prompt, "input_ids": ids, "output_ids": new}
        if tokenizer is not None:
            record["text"] = tokenizer.decode(new, skip_special_tokens=True)
        records.append(record)
    return records
