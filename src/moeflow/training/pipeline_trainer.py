"""The training loop of a pipelined run (``--pp-size P``): every worker runs its stages of the model
over a ``(pp, dp, ep)`` mesh, P x DP x EP = the workers (:mod:`moeflow.pipeline`).

As in the trainer without a pipeline, a step is a function of (seed, step, data rank) and the
checkpointed state: each of a stage's DP x EP data ranks reads its own batch, every stage of a
pipeline the same one. Checkpoints are the sharded ones (DCP, the model's names): a rank writes
its stages' parameters, so a run saved at one layout resumes at another that fits, P = 1 included.
Each step's record holds the MoE's health as without a pipeline: every stage's monitor watches its
own blocks and the stages' figures are joined (:mod:`moeflow.metrics.stages`).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moeflow.comm.collectives import all_gather_objects
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.mesh import timed_mesh
from moeflow.comm.topology import Topology
from moeflow.metrics import JsonlSink, MetricsSink, MoEMonitor, StepHealth
from moeflow.metrics.stages import StageHealth
from moeflow.pipeline import Pipeline, pipeline_stages
from moeflow.pipeline.groups import MESH_DIMS
from moeflow.runtime import give_back_free_memory
from moeflow.training.batches import token_windows, training_batch, validation_windows
from moeflow.training.checkpoint import load_checkpoint, save_checkpoint
from moeflow.training.faults import worker_ledger
from moeflow.training.metrics import PROGRESS, health_fields, metric_sinks, metrics_log, write_sinks
from moeflow.training.nonfinite import NonfiniteSteps
from moeflow.training.optimizer import build_optimizer, set_learning_rate
from moeflow.training.pipeline_settings import pipeline_microbatches
from moeflow.training.trainer import (
    Job,
    device_for,
    first_holders_planners,
    progress_bar,
    saved_planners_by_block,
)


@dataclass
class _PipelinedRun:
    """One worker's pipelined run: its mesh, its stages and what it has counted so far."""

    job: Job
    rank: int
    mesh: DeviceMesh
    pipeline: Pipeline
    optimizer: torch.optim.Optimizer
    train_stream: np.ndarray  # memory-mapped: every replica draws its rows of the global batch from it
    log: JsonlSink | None
    tokens_seen: int = 0
    throughput: list[float] = field(default_factory=list)
    last_loss: float = float("nan")
    val_loss: float | None = None
    checkpoint: Path | None = None
    nonfinite: NonfiniteSteps = field(init=False)
    monitor: MoEMonitor | None = None  # this rank's stages' MoE layers, over the stage's data ranks
    stage_health: StageHealth | None = None  # every stage's figures joined (every rank; None: no MoE block)
    sinks: list[MetricsSink] = field(default_factory=list)  # --tensorboard, --metrics-csv (rank 0)
    last_health: StepHealth | None = None

    def __post_init__(self) -> None:
        self.nonfinite = NonfiniteSteps(self.job.config.max_nonfinite_steps)

    @property
    def replica(self) -> int:
        """This worker's data rank in its stage (its batch's index): dp rank x EP + ep rank."""
        return self.mesh.get_local_rank("dp") * self.mesh.size(2) + self.mesh.get_local_rank("ep")

    @property
    def replicas(self) -> int:
        return self.mesh.size(1) * self.mesh.size(2)


def _start(rank: int, world_size: int, job: Job) -> tuple[_PipelinedRun, int]:
    """The mesh, this worker's stages and optimizer (from the checkpoint when resuming); the step it is at."""
    config = job.config
    device = device_for(config, rank if job.local_rank is None else job.local_rank)
    expert_size = config.expert_workers
    mesh = timed_mesh(device.type, (config.pp_size, config.stage_workers // expert_size, expert_size),
                      MESH_DIMS, timedelta(seconds=config.collective_timeout_s))
    ledger = worker_ledger(rank, world_size, Path(job.run_dir) / PROGRESS, job.faults)
    topology = Topology(world_size, config.ranks_per_node or job.ranks_per_node or world_size)
    experts = ParallelGroups.from_group(mesh.get_group("ep"), topology, ledger)
    pipeline = pipeline_stages(
        config.model_config(job.corpus.vocab_size), mesh, schedule=config.pp_schedule,
        microbatches=pipeline_microbatches(config), batch_size=config.batch_size, seq_len=config.context,
        seed=config.seed, expert_groups=experts, device=device, overlap=None if config.pp_overlap else False,
    )
    optimizer = build_optimizer(pipeline.model, config)
    start_step, tokens_seen, state = 0, 0, {}
    if job.resume_from is not None:
        state = load_checkpoint(Path(job.resume_from), pipeline.model, optimizer, rank, world_size)
        give_back_free_memory()
        start_step, tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
        _restore_planners(pipeline, state, rank, world_size)
    log = metrics_log(Path(job.run_dir), start_step if job.resume_from else None) if rank == 0 else None
    run = _PipelinedRun(job, rank, mesh, pipeline, optimizer, job.corpus.load("train"), log, tokens_seen)
    _watch_health(run, start_step if job.resume_from else None, state.get("monitor"))
    return run, start_step


def _watch_health(run: _PipelinedRun, resume_step: int | None, saved: dict[str, Any] | None) -> None:
    """The MoE's health, as the trainer without a pipeline keeps it: each rank's monitor watches its
    own stages' layers over its stage's data ranks (the pipeline's group, made up front by every
    rank), whose figures cover every rank's tokens; the stages' are joined each step."""
    config = run.job.config
    if not run.pipeline.model.config.moe_blocks:
        return
    if run.pipeline.moe_layers():  # a stage of dense blocks only reports nothing
        run.monitor = MoEMonitor(run.pipeline.model, run.pipeline.groups.data, config.health_rules(), warn=False,
                                 use_default_group=False)
    run.stage_health = StageHealth(config.health_rules())
    if saved is not None:  # the window and the alerts said go on (a run without a pipeline saved it too)
        run.stage_health.load_state_dict(saved)
        if run.monitor is not None:
            run.monitor.load_state_dict(saved)
    if run.rank == 0:
        run.sinks = metric_sinks(config, Path(run.job.run_dir), resume_step)


def _observe_health(run: _PipelinedRun, step: int, step_s: float) -> dict[str, Any]:
    """The step's health as the record's fields (``health``, ``alerts``, ``monitor_s``): the stage's
    all-reduce, then each stage's first data rank's figures and rank 0's step time to every rank
    (every rank makes both, in this order)."""
    if run.stage_health is None:
        return {}
    began = time.perf_counter()
    own = run.monitor.observe(step, step_s) if run.monitor is not None else None
    data = run.pipeline.groups.data
    first = data is None or dist.get_rank(data) == 0  # the stage's other ranks hold the same figures
    parts = all_gather_objects((step_s, own if first else None), dist.group.WORLD)
    run.last_health = run.stage_health.merge(step, parts[0][0], [health for _, health in parts])
    return {**health_fields(run.last_health), "monitor_s": time.perf_counter() - began}


def _train_step(run: _PipelinedRun, step: int) -> dict[str, Any]:
    """One optimizer step over the pipeline; returns its metrics record."""
    config = run.job.config
    began = time.perf_counter()
    lr = set_learning_rate(run.optimizer, config, step)
    idx, targets = training_batch(run.train_stream, step, run.replica, run.replicas, config.seed,
                                  config.batch_size, config.context)
    device = next(run.pipeline.parameters()).device
    data_s = time.perf_counter() - began
    loss = run.pipeline.step(idx.to(device), targets.to(device))
    compute_s = time.perf_counter() - began - data_s
    optimizer_began = time.perf_counter()
    grad_norm = run.pipeline.clip_gradients(config.grad_clip)
    skipped = run.nonfinite.skips(step, loss, grad_norm)
    if not skipped:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - began
    tokens = config.batch_size * config.context * run.replicas
    run.tokens_seen += tokens
    run.throughput.append(tokens / step_s)
    run.last_loss = loss
    return {"step": step, "loss": loss, "lr": lr, "skipped": skipped, "grad_norm": grad_norm,
            "tokens_per_s": tokens / step_s, "step_s": step_s, "tokens_seen": run.tokens_seen,
            "time_s": {"other": compute_s, "optimizer": time.perf_counter() - optimizer_began, "data": data_s},
            **_observe_health(run, step, step_s)}


def _validation_loss(run: _PipelinedRun) -> float:
    """The mean loss over the fixed validation windows, in whole batches of the training shape (a
    stage's shapes are fixed): each data rank its share of as many batches as fit, at least one."""
    config, stream = run.job.config, run.job.corpus.load("val")
    per_batch = config.batch_size * run.replicas
    starts = validation_windows(stream, max(1, config.eval_windows // per_batch) * per_batch, config.context)
    device = next(run.pipeline.parameters()).device
    losses = []
    for begin in range(0, len(starts), per_batch):
        mine = starts[begin + run.replica * config.batch_size : begin + (run.replica + 1) * config.batch_size]
        windows = token_windows(stream, mine, config.context).to(device)
        losses.append(run.pipeline.evaluate(windows[:, :-1], windows[:, 1:]))
    return statistics.fmean(losses)


def _evaluate_log_checkpoint(run: _PipelinedRun, step: int, last_step: int, record: dict[str, Any]) -> None:
    config = run.job.config
    if step % config.eval_interval == 0 or step == config.steps:
        run.val_loss = record["val_loss"] = _validation_loss(run)
        if run.monitor is not None:
            run.monitor.discard()  # the evaluation's forwards are not the next step's
    if run.log is not None:
        run.log.write_record(record)
        if run.last_health is not None:
            write_sinks(run.sinks, record, run.last_health)
    if step % config.checkpoint_interval == 0 or step == last_step:
        planners = {index: layer.planner.state_dict()
                    for index, layer in zip(run.pipeline.model.moe_block_indices(), run.pipeline.moe_layers(),
                                            strict=True)}
        seen = run.monitor.state_dict()["last_seen"] if run.monitor is not None else {}
        every_rank = all_gather_objects((planners, seen), dist.group.WORLD)  # each rank's own, by block
        state = {"tokens_seen": run.tokens_seen, "config": config.to_dict(), "corpus": run.job.corpus.to_dict(),
                 "loss": run.last_loss, "val_loss": run.val_loss,
                 "planners_by_rank_block": [planned for planned, _ in every_rank]}
        if run.stage_health is not None:  # the format of MoEMonitor.state_dict: either trainer resumes it
            last_seen = {block: when for _, held in every_rank for block, when in held.items()}
            state["monitor"] = run.stage_health.state_dict(last_seen)
        run.checkpoint = save_checkpoint(
            Path(run.job.run_dir), step, run.pipeline.model, run.optimizer, dist.group.WORLD, run.rank,
            config.workers, state, [run.job.corpus.tokenizer_path], config.keep_checkpoints,
            first_expert_copy=run.mesh.get_local_rank("dp") == 0,
        )


def _restore_planners(pipeline: Pipeline, state: dict[str, Any], rank: int, world_size: int) -> None:
    """Each held MoE layer's planner as the checkpoint saved it (:func:`planners_by_block`)."""
    by_block = planners_by_block(state, rank, world_size, pipeline.model.config.moe_blocks)
    for index, layer in zip(pipeline.model.moe_block_indices(), pipeline.moe_layers(), strict=True):
        if index in by_block:
            layer.planner.load_state_dict(by_block[index])


def planners_by_block(state: dict[str, Any], rank: int, world_size: int, moe_blocks: list[int]) -> dict[int, Any]:
    """The planners a rank resumes with, by block: its own where the checkpoint was saved by as
    many ranks (a search in progress holds the rank's own trial times), else each block's first
    holder's; from a run without a pipeline, rank 0's list in block order."""
    if "planners_by_rank_block" in state:
        saved = saved_planners_by_block(state)
        return saved[rank] if len(saved) == world_size else first_holders_planners(saved)
    by_rank = state.get("planners_by_rank") or [state.get("planners", [])]
    return dict(zip(moe_blocks, by_rank[0], strict=False))


def pipeline_train_worker(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """Train (or continue) a pipelined run; rank 0 returns the run's summary."""
    run, start_step = _start(rank, world_size, job)
    config = job.config
    progress = progress_bar(config, rank, start_step)
    last_step = config.stop_at or config.steps
    try:
        for step in range(start_step + 1, last_step + 1):
            with run.pipeline.model.groups.ledger.at(step=step, phase="training"):
                record = _train_step(run, step)
                _evaluate_log_checkpoint(run, step, last_step, record)
            progress.set_postfix({"loss": f"{run.last_loss:.3f}"}, refresh=False)
            progress.update(1)
            for alert in record.get("alerts", []) if rank == 0 else []:  # said once, above the bar
                progress.write(f"moeflow train: warning: {alert['message']}", file=sys.stderr)
    finally:
        progress.close()
        run.pipeline.model.groups.worker.shutdown()
        if run.log is not None:
            run.log.close()
        if run.monitor is not None:
            run.monitor.close()  # its hooks
        for sink in run.sinks:
            sink.close()
    return {
        "steps": last_step, "workers": world_size, "pp_size": config.pp_size, "pp_schedule": config.pp_schedule,
        "microbatches": pipeline_microbatches(config), "ep_size": config.expert_workers,
        "loss": run.last_loss, "val_loss": run.val_loss,
        "unigram_entropy": job.corpus.unigram_entropy, "unigram_val_loss": job.corpus.unigram_val_loss,
        "median_tokens_per_s": statistics.median(run.throughput) if run.throughput else None,
        "checkpoint": str(run.checkpoint) if run.checkpoint else None, "run_dir": str(Path(job.run_dir)),
        "skipped_steps": run.nonfinite.skipped,
    }
