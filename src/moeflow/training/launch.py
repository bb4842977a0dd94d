"""Start a training run: check the config and the data, prepare the run folder, then run the
workers — spawned here (gloo processes on this machine), or, when a launcher already started this
process as one rank (``torchrun``, ``moeflow launch``: RANK and WORLD_SIZE are set), as that rank.

Bad input fails here, before any worker starts. A worker that dies ends the job: the spawner
notices within about two seconds and names it; the surviving workers are stopped, and the last
checkpoint, written atomically, stays intact.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.collectives import broadcast_objects
from moeflow.comm.topology import topology_from_environment
from moeflow.data import PreparedCorpus, default_cache_root
from moeflow.distributed import destroy_process_groups
from moeflow.training.batches import require_windows
from moeflow.training.checkpoint import read_state, resumable_checkpoint
from moeflow.training.config import TrainConfig, checked_keys
from moeflow.training.corpus import prepared_corpus
from moeflow.training.faults import FaultPlan
from moeflow.training.metrics import METRICS
from moeflow.training.trainer import Job, device_for, train_worker


def worker_for(config: TrainConfig) -> Callable[[int, int, Job], dict[str, Any]]:
    """The training loop every worker runs: the pipelined one with ``--pp-size`` > 1."""
    if config.pp_size > 1:
        from moeflow.training.pipeline_trainer import pipeline_train_worker

        return pipeline_train_worker
    return train_worker


def launched_by_torchrun() -> bool:
    """Whether a launcher started this process as one rank (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resume_config(resume: str, overrides: dict[str, Any]) -> tuple[TrainConfig, Path]:
    """The config of the run being resumed (from its newest checkpoint) with ``overrides`` applied."""
    checkpoint = resumable_checkpoint(Path(resume))
    if checkpoint is None:
        raise FileNotFoundError(
            f"no checkpoint found under {resume!r}; --resume takes a run folder (or one of its "
            "checkpoints/step-* folders) written by moeflow train"
        )
    saved = read_state(checkpoint)["config"]
    config = TrainConfig(**checked_keys({**saved, "stop_at": None}, "checkpoint")).updated(overrides)
    return config, checkpoint


def check_data_fits(config: TrainConfig, corpus: PreparedCorpus) -> None:
    """The workers' own checks, made here so that they fail before any worker starts."""
    require_windows(corpus.train_tokens, context=config.context, what="the training data",
                    fix="use more data or a shorter --context")
    require_windows(corpus.val_tokens, context=config.context, what="the validation split",
                    fix="use more data, a larger --val-percent or a shorter --context")


def _prepare_corpus(config: TrainConfig) -> PreparedCorpus:
    """The corpus in this machine's cache (``MOEFLOW_CACHE``, read here at the entry point), with
    the --hf model's own tokenizer when there is one."""
    return prepared_corpus(config, default_cache_root(os.environ))


def _model_settings(config: TrainConfig) -> dict[str, dict[str, Any]]:
    """What a --hf model sets for the run, with where each value came from (none without --hf)."""
    if config.hf is None:
        return {}
    from moeflow.training.hf_model import model_settings, read_hf_info

    return model_settings(config, read_hf_info(config.hf))


def prepare_job(config: TrainConfig, checkpoint: Path | None = None) -> Job:
    """Corpus, run folder and saved config; errors before any worker exists."""
    corpus = _prepare_corpus(config)
    check_data_fits(config, corpus)
    if checkpoint is not None:
        run_dir = checkpoint.parent.parent  # experts are resliced for this run's number of workers
    else:
        run_dir = Path(config.run_dir or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
        if (run_dir / METRICS).exists():
            raise FileExistsError(
                f"run folder {str(run_dir)!r} already holds a run; continue it with --resume {run_dir} "
                "or choose another --run-dir"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    config = config.updated({"run_dir": str(run_dir)})
    config.save(run_dir / "config.json", _model_settings(config))
    if config.plan is not None and checkpoint is None:
        from moeflow.training.plan_file import RUN_RECORD, run_record

        (run_dir / RUN_RECORD).write_text(json.dumps(run_record(config), indent=2) + "\n")
    (run_dir / "corpus.json").write_text(json.dumps(corpus.to_dict(), indent=2) + "\n")
    return Job(config, corpus, str(run_dir), str(checkpoint) if checkpoint is not None else None)


def completed_run(config: TrainConfig, checkpoint: Path | None) -> dict[str, Any] | None:
    """The summary of a resumed run that already reached its last step (nothing to train), else None."""
    if checkpoint is None:
        return None
    step = int(read_state(checkpoint)["step"])
    if step < config.steps:
        return None
    return {"complete": True, "step": step, "steps": config.steps, "run_dir": str(checkpoint.parent.parent),
            "checkpoint": str(checkpoint)}


def run_training(
    config: TrainConfig, checkpoint: Path | None = None, report: bool = True, faults: FaultPlan | None = None
) -> dict[str, Any]:
    """Train; return rank 0's summary (every rank returns it when started by a launcher). A resumed
    run that is already complete trains nothing and says so (``"complete": true``). ``faults``:
    faults to inject on purpose (the tests)."""
    completed = completed_run(config, checkpoint)
    if completed is not None:
        return completed
    if launched_by_torchrun():
        return _run_as_launched_rank(config, checkpoint, report)
    from moeflow.distributed import run_distributed

    job = replace(prepare_job(config, checkpoint), faults=faults)
    summary = run_distributed(
        worker_for(job.config), job.config.workers, job, threads_per_worker=job.config.threads_per_worker,
        timeout_s=float("inf"), collective_timeout_s=job.config.collective_timeout_s,
    )[0]
    if report:
        summary = _with_plan(summary, _report(Path(job.run_dir)))
    return summary


def _run_as_launched_rank(config: TrainConfig, checkpoint: Path | None, report: bool) -> dict[str, Any]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks_per_node = topology_from_environment(os.environ, world_size).ranks_per_node
    config = launched_config(config, world_size, ranks_per_node)
    torch.set_num_threads(config.threads_per_worker)
    device_for(config, local_rank)  # before the first collective
    dist.init_process_group(
        config.backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=config.collective_timeout_s)
    )
    try:
        job = [prepare_job(config, checkpoint) if rank == 0 else None]
        broadcast_objects(job, 0)  # one run folder for all ranks
        assert job[0] is not None
        if rank != 0:  # every other rank prepares (or finds) the corpus in its own node's cache
            job[0] = replace(job[0], corpus=_prepare_corpus(config))
        worker = worker_for(config)
        summary = worker(rank, world_size, replace(job[0], ranks_per_node=ranks_per_node, local_rank=local_rank))
    finally:
        destroy_process_groups()
    if report and rank == 0:
        summary = _with_plan(summary, _report(Path(summary["run_dir"])))
    return summary


def launched_config(config: TrainConfig, world_size: int, ranks_per_node: int) -> TrainConfig:
    """``config`` for the launcher's ranks. A config for as many workers keeps its layout (its
    ``ep_size``); another count spreads the experts over every worker, except a plan's, which is
    refused: it was planned for its own workers and nodes."""
    if config.plan is not None:
        planned = (config.workers, config.ranks_per_node or config.workers)
        if planned != (world_size, ranks_per_node):
            raise ValueError(f"the plan {config.plan} is for {planned[0]} workers, {planned[1]} per node; the launcher "
                             f"started {world_size}, {ranks_per_node} per node: plan for this cluster (moeflow plan "
                             "--out) or launch the plan's layout")
    if config.workers == world_size:
        return config
    return config.updated({"workers": world_size})


def _report(run_dir: Path) -> dict[str, Any]:
    from moeflow.training.report import write_report

    return write_report(run_dir)


def _with_plan(summary: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The run's summary with the plan's predicted step time beside the measured one, if it ran a plan."""
    return {**summary, "plan": report["plan"]} if "plan" in report else summary
