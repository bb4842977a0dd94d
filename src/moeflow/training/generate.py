"""Sample text from a checkpoint, in one process or with the experts spread over gloo workers
(each reads only its own experts from the sharded checkpoint)."""

from __future__ import annotations

import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.data import PreparedCorpus, load_tokenizer
from moeflow.files import json_text, write_atomic
from moeflow.metrics import MoEMonitor
from moeflow.models import MoETransformer
from moeflow.parallel.registry import DEFAULT_SCHEDULE
from moeflow.training.checkpoint import latest_checkpoint, load_checkpoint, read_state
from moeflow.training.config import TrainConfig, checked_keys
from moeflow.training.corpus import prepared_corpus
from moeflow.training.faults import FaultPlan, worker_ledger


def load_model(path: str, groups: ParallelGroups | None = None) -> tuple[MoETransformer, object, Path]:
    """The model of a checkpoint (a run folder or one of its step folders), its tokenizer and path;
    on one process, or with its experts over ``groups`` (a collective: every rank loads its part)."""
    checkpoint = latest_checkpoint(Path(path))
    if checkpoint is None:
        raise FileNotFoundError(
            f"no checkpoint found under {path!r}; pass a run folder written by moeflow train or one of "
            "its checkpoints/step-* folders"
        )
    state = read_state(checkpoint)
    if state["config"].get("hf"):
        raise ValueError(
            f"{str(checkpoint)!r} is from a run that fine-tuned a transformers model (--hf); generate from the "
            "transformers directory it wrote at the end: moeflow generate --hf <run-dir>/hf --prompts FILE"
        )
    # the plain expert-parallel layer: no pipelining (of chunks or of stages), all-to-all choice or re-placed experts
    workers = 1 if groups is None else groups.size
    plain = {"workers": workers, "pipeline": 1, "alltoall": "linear", "profile": None, "shadowing": "off",
             "topology_gate": "off", "redundant_experts": 0, "balance": "fixed", "parallel": DEFAULT_SCHEDULE,
             "mp_size": 1, "esp_size": None, "expert_packing": "off", "pp_size": 1, "microbatches": None}
    config = TrainConfig(**checked_keys(state["config"], "checkpoint")).updated(plain)
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    model = MoETransformer(config.model_config(tokenizer.get_vocab_size()), group=groups)
    load_checkpoint(checkpoint, model, None, rank=0 if groups is None else groups.rank, world_size=workers)
    model.eval()
    return model, tokenizer, checkpoint


def checkpoint_corpus(checkpoint: Path, cache_root: Path) -> PreparedCorpus:
    """The corpus a checkpoint's run trained on, from the cache under ``cache_root`` (built if missing)."""
    return prepared_corpus(TrainConfig(**checked_keys(read_state(checkpoint)["config"], "checkpoint")), cache_root)


def generate_text(
    path: str, prompt: str, new_tokens: int = 200, temperature: float = 0.8, top_k: int | None = 50, seed: int = 0,
    workers: int = 1, faults: FaultPlan | None = None, collective_timeout_s: float = 60.0,
    progress_dir: Path | None = None, health_path: Path | None = None,
) -> str:
    """``new_tokens`` sampled after ``prompt``; with ``workers`` > 1 the experts are spread over that
    many gloo processes, which all sample the same tokens (the same logits and the same seed).
    ``faults``: faults to inject on purpose (the tests); ``progress_dir``: where the workers' progress
    files go (default: a temporary folder); ``health_path``: a JSON file of the MoE layers' health over
    the generation (every worker's tokens)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if workers == 1:
        return _sample(path, (prompt, new_tokens, temperature, top_k, seed), None, health_path)
    from moeflow.distributed import run_distributed

    folder = nullcontext(str(progress_dir)) if progress_dir else tempfile.TemporaryDirectory(prefix="moeflow-progress-")
    with folder as progress:
        sampling = (prompt, new_tokens, temperature, top_k, seed)
        return run_distributed(_sample_worker, workers, path, sampling, progress, faults, health_path,
                               collective_timeout_s=collective_timeout_s)[0]


def _sample_worker(rank: int, world_size: int, path: str, sampling: tuple[Any, ...], progress: str,
                   faults: FaultPlan | None, health_path: Path | None) -> str:
    ledger = worker_ledger(rank, world_size, Path(progress), faults)
    groups = ParallelGroups.from_group(None, ledger=ledger)
    return _sample(path, sampling, groups, health_path)


def _sample(path: str, sampling: tuple[Any, ...], groups: ParallelGroups | None, health_path: Path | None) -> str:
    """Sample on this worker; with ``health_path`` (every worker alike), the monitor watches the
    generation and the first worker writes its figures there."""
    prompt, new_tokens, temperature, top_k, seed = sampling
    model, tokenizer, _ = load_model(path, groups)
    ids = tokenizer.encode(prompt).ids or [tokenizer.token_to_id("<|endoftext|>")]
    generator = torch.Generator().manual_seed(seed)
    watched = health_path is not None
    monitor = MoEMonitor(model, None if groups is None else groups.expert, use_default_group=False) if watched else None
    with model.groups.ledger.at(phase="generation"):
        out = model.generate(torch.tensor([ids]), new_tokens, temperature, top_k, generator)
    if monitor is not None:  # the whole generation as one step: a collective on every worker
        figures = monitor.observe(1).record()
        monitor.close()
        if model.groups.rank == 0:
            write_atomic(Path(health_path), json_text(figures) + "\n")
    return tokenizer.decode(out[0].tolist())
