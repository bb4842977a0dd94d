"""The training loop that runs in every worker: data parallel for the replicated parameters (one
gradient all-reduce per step), expert parallel for the experts (the MoE layers' all-to-alls).

Everything a step does is a function of (seed, step, rank) and the checkpointed state, so a resumed
run repeats the losses of an uninterrupted one. Rank 0 writes the metrics and the checkpoints.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeflow.comm.collectives import all_gather_objects
from moeflow.comm.groups import ParallelGroups, proper_divisors
from moeflow.comm.ledger import CollectiveLedger, tracked
from moeflow.comm.mesh import timed_mesh
from moeflow.comm.topology import Topology
from moeflow.comm.traffic import TimelineEvent, contention_seconds
from moeflow.data import PreparedCorpus
from moeflow.metrics import JsonlSink, MetricsSink, MoEMonitor, StepHealth
from moeflow.models import MoETransformer, TrainableLM
from moeflow.models.transformer import phase_seconds
from moeflow.runtime import give_back_free_memory
from moeflow.training.batches import data_replica, training_batch
from moeflow.training.checkpoint import load_checkpoint, save_checkpoint
from moeflow.training.config import TrainConfig
from moeflow.training.data_parallel import EXPERT_PARALLEL_DIM, EXPERT_REPLICA_DIM
from moeflow.training.evaluation import autocast, evaluate
from moeflow.training.faults import FaultPlan, worker_ledger
from moeflow.training.grad_sync import GradientScheduler, gradient_scheduler
from moeflow.training.gradients import (
    all_reduce_sum,
    clip_gradients,
    packed_block,
    replicated_parameters,
    synchronize_gradients,
)
from moeflow.training.metrics import (
    PROGRESS,
    TIMELINE,
    health_fields,
    metric_sinks,
    metrics_log,
    moe_records,
    write_sinks,
    write_timeline,
)
from moeflow.training.nonfinite import NonfiniteSteps
from moeflow.training.optimizer import build_optimizer, set_learning_rate
from moeflow.training.packing import ExpertPacker, MicroOpTimes, TrafficMark, micro_op_times, parse_packing
from moeflow.training.rebalance import ExpertRebalancer

HF_CHECKPOINT = "hf"
"""With ``--hf``: the run folder's transformers directory, written at the end of the run."""


@dataclass(frozen=True)
class Job:
    """What every worker needs to know: picklable, sent to spawned workers."""

    config: TrainConfig
    corpus: PreparedCorpus
    run_dir: str
    resume_from: str | None = None
    ranks_per_node: int | None = None  # the launcher's LOCAL_WORLD_SIZE; None: all workers on one node
    local_rank: int | None = None  # the launcher's LOCAL_RANK; None: the rank (spawned workers)
    faults: FaultPlan | None = None  # faults injected on purpose (tests)


# -- the loop ------------------------------------------------------------------------------------


def unscale_gradients(run: _Run, expert_sq_global: float) -> float:
    """fp16: the gradients divided by the loss scale; returns the experts' squared norm likewise.
    Each rank's scaler sees only its own expert gradients, so where any rank's overflowed (the
    global norm is not finite) every rank marks its own as overflowed too: all of them skip the
    step and back the scale off together."""
    assert run.scaler is not None
    if not math.isfinite(expert_sq_global):
        next(p.grad for p in run.model.parameters() if p.grad is not None).fill_(float("inf"))
    run.scaler.unscale_(run.optimizer)
    return expert_sq_global / run.scaler.get_scale() ** 2


def device_for(config: TrainConfig, local_rank: int) -> torch.device:
    """This process's device; for NCCL it also makes it current (NCCL uses the current device)."""
    if config.backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def progress_bar(config: TrainConfig, rank: int, start: int) -> Any:
    """Rank 0's bar of the run's steps (off with --no-progress and on the other ranks)."""
    from tqdm import tqdm

    return tqdm(
        total=config.steps, initial=start, disable=rank != 0 or not config.progress, unit="step",
        dynamic_ncols=True, mininterval=0.5, desc="train",
    )


@dataclass
class _Run:
    """One worker's training run: what it built and what it has counted so far."""

    job: Job
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None
    model: TrainableLM
    optimizer: torch.optim.Optimizer
    train_stream: np.ndarray  # memory-mapped: every replica draws its rows of the global batch from it
    val_stream: np.ndarray
    log: JsonlSink | None
    tokens_seen: int = 0
    throughput: list[float] = field(default_factory=list)
    val_loss: float | None = None
    last_loss: float = float("nan")
    checkpoint: Path | None = None
    rebalancer: ExpertRebalancer | None = None
    packer: ExpertPacker | None = None
    grad_scheduler: GradientScheduler | None = None
    nonfinite: NonfiniteSteps = field(init=False)  # the config's limit of non-finite steps in a row
    copy_scheduler: GradientScheduler | None = None  # packed experts' copies, during the backward
    expert_replicas: dist.ProcessGroup | None = None  # --ep-size: the workers holding this one's experts
    head_replicas: dist.ProcessGroup | None = None  # --mp-size: the workers holding this one's attention heads
    copy_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)  # packed copies' groups, by block size
    scaler: torch.amp.GradScaler | None = None  # --dtype fp16's loss scaler
    monitor: MoEMonitor | None = None  # the MoE's health per step (every rank: its figures are global)
    sinks: list[MetricsSink] = field(default_factory=list)  # --tensorboard, --metrics-csv (rank 0)
    last_health: StepHealth | None = None

    def __post_init__(self) -> None:
        self.nonfinite = NonfiniteSteps(self.job.config.max_nonfinite_steps)
    expert_names: set[str] = field(default_factory=set)
    last_timeline: list[TimelineEvent] = field(default_factory=list)  # the last step's events (rank 0)

    @property
    def config(self) -> TrainConfig:
        return self.job.config

    @property
    def ledger(self) -> CollectiveLedger:
        return self.model.groups.ledger

    @property
    def replica(self) -> int:
        return data_replica(self.rank, self.world_size, self.config.mp_size)[0]

    @property
    def replicas(self) -> int:
        return data_replica(self.rank, self.world_size, self.config.mp_size)[1]

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.context * self.replicas


def build_model(config: TrainConfig, corpus: PreparedCorpus, groups: ParallelGroups,
                device: torch.device) -> TrainableLM:
    """moeflow's own model, initialised from the seed, or the --hf model with its weights."""
    if config.hf is not None:
        from moeflow.training.hf_model import build_hf_model

        return build_hf_model(config, groups, device)
    return MoETransformer(config.model_config(corpus.vocab_size), group=groups, seed=config.seed,
                          profile=config.profile).to(device)


def _start_run(rank: int, world_size: int, job: Job) -> tuple[_Run, int]:
    """Build the model and optimizer (from the checkpoint when resuming); return the step it is at."""
    config, corpus = job.config, job.corpus
    device = device_for(config, rank if job.local_rank is None else job.local_rank)
    group = dist.group.WORLD if dist.is_initialized() else None
    topology = Topology(world_size, config.ranks_per_node or job.ranks_per_node or world_size)
    mp_group, head_replicas = tensor_parallel_layout(config, world_size, device)
    ledger = worker_ledger(rank, world_size, Path(job.run_dir) / PROGRESS, job.faults)
    experts, replicas = expert_layout(config, world_size, device)
    groups = ParallelGroups.from_group(experts or group, topology, ledger)
    if rank == 0:
        warn_one_node(config, groups)
    groups.model = mp_group  # the MoE layers behind tensor-parallel attention run Parm's schedules
    model = build_model(config, corpus, groups, device)
    optimizer = build_optimizer(model, config)
    start_step, tokens_seen, state = 0, 0, None
    rebalancer = (ExpertRebalancer(config.rebalance_interval, config.rebalance_window, replicas=replicas)
                  if config.redundant_experts else None)
    if job.resume_from is not None:
        state = load_checkpoint(Path(job.resume_from), model, optimizer, rank, world_size)
        give_back_free_memory()  # the reader's transient copies
        start_step, tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
        if rebalancer is not None:
            rebalancer.restore(state.get("rebalancer", {}), model, optimizer)
    packer = _packer(config, model, optimizer, state, replicas)
    for layer, planned in zip(model.moe_layers(), rank_planner_states(state or {}, rank, world_size), strict=False):
        layer.planner.load_state_dict(planned)  # the same plans as the interrupted run: bit-exact under auto
    log = metrics_log(Path(job.run_dir), start_step if job.resume_from else None) if rank == 0 else None
    run = _Run(job, rank, world_size, device, group, model, optimizer, corpus.load("train"), corpus.load("val"), log,
               tokens_seen, rebalancer=rebalancer, packer=packer, expert_names=model.expert_parameter_names(),
               expert_replicas=replicas, head_replicas=head_replicas)
    run.copy_groups = _copy_groups(run)
    run.grad_scheduler, run.copy_scheduler = _gradient_scheduler(run), _copy_scheduler(run)
    if config.dtype == "fp16":
        run.scaler = torch.amp.GradScaler(device.type)
        if state is not None and "grad_scaler" in state:
            run.scaler.load_state_dict(state["grad_scaler"])
    model.groups.traffic.timeline.enabled = rank == 0  # the step's events behind comm_s and timeline.json
    if model.moe_layers():
        run.monitor = MoEMonitor(model, group, config.health_rules(), warn=False, use_default_group=False)
        if state is not None and "monitor" in state:
            run.monitor.load_state_dict(state["monitor"])  # its window and the alerts said go on
    if rank == 0:
        run.sinks = metric_sinks(config, Path(job.run_dir), start_step if job.resume_from else None)
    return run, start_step


def expert_layout(
    config: TrainConfig, world_size: int, device: torch.device
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``--ep-size N``: the workers on a (dp, ep) DeviceMesh, the MoE layers' expert group this
    worker's ``"ep"`` row of N consecutive workers and the experts' replicas its ``"dp"`` column;
    (None, None) where the experts span every worker."""
    if config.expert_workers == world_size:
        return None, None
    mesh = timed_mesh(device.type, (world_size // config.expert_workers, config.expert_workers),
                      (EXPERT_REPLICA_DIM, EXPERT_PARALLEL_DIM), timedelta(seconds=config.collective_timeout_s))
    return mesh[EXPERT_PARALLEL_DIM].get_group(), mesh[EXPERT_REPLICA_DIM].get_group()


def tensor_parallel_layout(
    config: TrainConfig, world_size: int, device: torch.device
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``--mp-size N``: the workers on a (replica, mp) DeviceMesh, the tensor-parallel group this
    worker's ``"mp"`` row of N consecutive workers (Parm's MP group) and the workers holding the
    same attention heads its ``"replica"`` column, N apart over the whole world (whatever the expert
    group); (None, None) without tensor parallelism."""
    if config.mp_size == 1:
        return None, None
    mesh = timed_mesh(device.type, (world_size // config.mp_size, config.mp_size), ("replica", "mp"),
                      timedelta(seconds=config.collective_timeout_s))
    return mesh["mp"].get_group(), mesh["replica"].get_group()


def warn_one_node(config: TrainConfig, groups: ParallelGroups) -> None:
    """Say so when a topology-aware option meets an expert group on one node, where it changes nothing."""
    asked = [flag for flag, on in ((f"--alltoall {config.alltoall}", config.alltoall in ("2dh", "pairwise")),
                                   ("--pipeline smart", config.pipeline == "smart"),
                                   ("--topology-gate", config.topology_gate != "off")) if on]
    if asked and groups.size > 1 and groups.topology.num_nodes == 1:
        warnings.warn(f"{', '.join(asked)}: the expert group's {groups.size} workers sit on one node, where this "
                      "changes nothing; give the node layout with --ranks-per-node (or launch across nodes)",
                      stacklevel=2)


def _packer(config: TrainConfig, model: TrainableLM, optimizer: torch.optim.Optimizer,
            state: dict[str, Any] | None, replicas: dist.ProcessGroup | None) -> ExpertPacker | None:
    """Lina's expert packing (``--expert-packing``): a fixed packing as asked (also on resume: the
    flag wins); auto as the checkpoint left it, deciding alike on the expert groups' copies."""
    packing = parse_packing(config.expert_packing)
    if packing == "off":
        return None
    packer = ExpertPacker(packing, config.packing_warmup, config.packing_interval, replicas=replicas)
    if packing == "auto" and state is not None and "packer" in state:
        packer.restore(state["packer"], model, optimizer)
    else:
        packer.start(model, optimizer)
    return packer


def _gradient_scheduler(run: _Run) -> GradientScheduler | None:
    """``--grad-sync overlap|lina``: the scheduler of the replicated gradients, on a process group of
    its own (so that its all-reduces run beside the all-to-alls of the world group)."""
    config = run.config
    if config.grad_sync == "after" or run.group is None or run.world_size == 1:
        return None
    own_group = dist.new_group(list(range(run.world_size)), timeout=timedelta(seconds=config.collective_timeout_s))
    return gradient_scheduler(
        config.grad_sync, replicated_parameters(run.model, run.expert_names), own_group, run.world_size,
        run.model.groups.traffic, config.microop_mb, config.bucket_mb, run.ledger,
    )


def _copy_groups(run: _Run) -> dict[int, dist.ProcessGroup]:
    """The groups over which packed experts' copies add up, by block size, made at setup by every
    worker in one order (NCCL splits a communicator only when every rank takes part): for each
    block size that divides the workers, the workers a block apart, across the expert groups too
    (their copies are data-parallel replicas of each other). None made without a copy scheduler."""
    config = run.config
    if config.grad_sync == "after" or run.group is None or run.packer is None:
        return {}
    groups = {}
    for block in (1, *proper_divisors(run.world_size)):  # block 1: every worker holds every expert
        groups[block], _ = dist.new_subgroups_by_enumeration(
            [list(range(first, run.world_size, block)) for first in range(block)],
            timeout=timedelta(seconds=config.collective_timeout_s))
    return groups


def _copy_scheduler(run: _Run) -> GradientScheduler | None:
    """``--grad-sync overlap|lina`` with packed experts: their copies add up during the backward
    too (Lina schedules them with the replicated gradients), on a group of their own per block
    size: the workers holding the same experts, in every expert group (:func:`_copy_groups`)."""
    config, placed = run.config, run.model.placed_parameters()
    if config.grad_sync == "after" or run.group is None or run.packer is None:
        return None
    packed = {name: block for name, parameter in run.model.named_parameters() if name in run.expert_names
              and (block := packed_block(placed.get(name))) is not None}
    if not packed:
        return None
    block = next(iter(packed.values()))
    if block not in run.copy_groups:  # one block of every rank: no copies to add up
        return None
    parameters = [parameter for name, parameter in run.model.named_parameters() if name in packed]
    return gradient_scheduler(config.grad_sync, parameters, run.copy_groups[block], run.world_size,
                              run.model.groups.traffic, config.microop_mb, config.bucket_mb, run.ledger)


def _train_step(run: _Run, step: int) -> dict[str, Any]:
    """One optimizer step; returns its metrics record (phase times included)."""
    config, model, expert_names = run.config, run.model, run.expert_names
    began = time.perf_counter()
    lr = set_learning_rate(run.optimizer, config, step)
    inputs, targets = training_batch(run.train_stream, step, run.replica, run.replicas, config.seed,
                                     config.batch_size, config.context)
    inputs, targets = inputs.to(run.device), targets.to(run.device)
    data_s = time.perf_counter() - began

    model.clock.reset()
    timeline = model.groups.traffic.timeline
    timeline.take()  # this step's events only (evaluation ran all-to-alls too)
    traffic_began = TrafficMark.of(model.groups.traffic)
    forward_began = time.perf_counter()
    for scheduler in (run.grad_scheduler, run.copy_scheduler):
        if scheduler is not None:
            scheduler.start()
    with autocast(config, run.device):
        _, loss = model(inputs, targets)
    if run.job.faults is not None:
        loss = run.job.faults.loss(loss, run.rank, step)
    backward_began = time.perf_counter()
    (loss if run.scaler is None else run.scaler.scale(loss)).backward()
    compute_s = time.perf_counter() - forward_began
    timeline.record("forward", forward_began, backward_began)
    timeline.record("backward", backward_began, forward_began + compute_s)

    sync_began = time.perf_counter()
    with tracked(run.ledger, "gradient all-reduce", run.group, phase="gradient sync"):
        expert_sq = synchronize_gradients(model, expert_names, run.group, run.world_size, run.grad_scheduler,
                                          run.copy_scheduler, run.expert_replicas, run.head_replicas)
    lm_loss = float(model.last_lm_loss) if model.last_lm_loss is not None else float("nan")
    lm_sum, total_sum, expert_sq_global = all_reduce_sum([lm_loss, float(loss.detach()), expert_sq], run.group,
                                                          run.device, run.ledger)
    sync_s = time.perf_counter() - sync_began
    optimizer_began = time.perf_counter()
    if run.scaler is not None:
        expert_sq_global = unscale_gradients(run, expert_sq_global)
    grad_norm = clip_gradients(model, expert_names, expert_sq_global, config.grad_clip)
    # fp16's loss scaler skips an overflowing step itself (and lowers the scale): only the loss counts there
    skipped = run.nonfinite.skips(step, total_sum, grad_norm if run.scaler is None else 0.0)
    if run.scaler is None:
        if not skipped:
            run.optimizer.step()
    else:  # skipped where the gradients overflowed
        if not skipped:
            run.scaler.step(run.optimizer)
        run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    moe = moe_records(model)  # how this step ran, before a rebalance changes the layers
    rebalanced = []
    if run.rebalancer is not None:  # EPLB: the slots follow the recorded load every few steps
        run.rebalancer.record(model)
        rebalanced = run.rebalancer.step(step, model, run.optimizer)
    packing = _pack(run, step, micro_op_times(model, traffic_began)) if run.packer is not None else None
    optimizer_s = time.perf_counter() - optimizer_began
    step_s = time.perf_counter() - began
    run.tokens_seen += run.tokens_per_step
    run.throughput.append(run.tokens_per_step / step_s)
    run.last_loss = lm_sum / run.world_size

    phases = phase_seconds(model)
    phases["other"] = max(0.0, compute_s - sum(phases.values()))
    phases.update(grad_sync=sync_s, optimizer=optimizer_s, data=data_s)
    if timeline.enabled:
        run.last_timeline = timeline.take()
    monitor_began = time.perf_counter()
    run.last_health = run.monitor.observe(step, step_s) if run.monitor is not None else None
    monitor_s = time.perf_counter() - monitor_began
    return {
        "step": step, "loss": run.last_loss, "aux_loss": (total_sum - lm_sum) / run.world_size, "lr": lr,
        "skipped": skipped,
        "grad_norm": grad_norm, "tokens_per_s": run.tokens_per_step / step_s, "step_s": step_s,
        "tokens_seen": run.tokens_seen, "time_s": phases, "comm_s": contention_seconds(run.last_timeline),
        "moe": moe, **(health_fields(run.last_health) if run.last_health else {}), "monitor_s": monitor_s,
        **({"rebalanced_blocks": rebalanced} if run.rebalancer is not None else {}),
        **({"packing": packing} if packing is not None else {}),
        **({"loss_scale": run.scaler.get_scale()} if run.scaler is not None else {}),
    }


def _pack(run: _Run, step: int, times: MicroOpTimes | None) -> dict[str, Any]:
    """Lina's packer after the update: this step's micro-op times, then its decision."""
    assert run.packer is not None
    run.packer.record(times)
    packed = run.packer.step(step, run.model, run.optimizer)
    if packed:  # the new expert Parameters' copies get a scheduler of their own
        run.copy_scheduler = _copy_scheduler(run)
    return {
        "experts_per_worker": run.model.moe_layers()[0].experts_per_rank, "packed": packed,
        "expert_op_s": times.expert_s if times else None, "alltoall_op_s": times.alltoall_s if times else None,
    }


def _evaluate_log_checkpoint(run: _Run, step: int, last_step: int, record: dict[str, Any]) -> None:
    """Validation when due, the metrics line, then the checkpoint when due (in that order: a resume
    from the checkpoint finds this step's record)."""
    config, corpus = run.config, run.job.corpus
    if step % config.eval_interval == 0 or step == config.steps:
        give_back_free_memory()  # the step's freed buffers: the evaluation's shapes differ
        with run.ledger.at(phase="evaluation"):
            run.val_loss = evaluate(run.model, run.val_stream, config, run.replica, run.replicas, run.group,
                                    run.device)
        if run.monitor is not None:
            run.monitor.discard()  # the evaluation's forwards are not the next step's
        record["val_loss"] = run.val_loss
    if run.log is not None:
        run.log.write_record(record)
        if run.last_health is not None:
            write_sinks(run.sinks, record, run.last_health)
        if "val_loss" in record:  # the timeline of a step now and then (the report draws the last)
            write_timeline(Path(run.job.run_dir) / TIMELINE, step, run.last_timeline)
    if step % config.checkpoint_interval == 0 or step == last_step:
        planners = [layer.planner.state_dict() for layer in run.model.moe_layers()]
        every_rank = all_gather_objects(planners, run.group) if run.group is not None else [planners]
        state = {"tokens_seen": run.tokens_seen, "config": config.to_dict(), "corpus": corpus.to_dict(),
                 "loss": run.last_loss, "val_loss": run.val_loss, "planners_by_rank": every_rank,
                 **({"grad_scaler": run.scaler.state_dict()} if run.scaler is not None else {})}
        if run.rebalancer is not None:
            state["rebalancer"] = run.rebalancer.state()
        if run.packer is not None:
            state["packer"] = run.packer.state()
        if run.monitor is not None:
            state["monitor"] = run.monitor.state_dict()
        with tracked(run.ledger, "checkpoint save", run.group, phase="checkpoint"):
            run.checkpoint = save_checkpoint(
                Path(run.job.run_dir), step, run.model, run.optimizer, run.group, run.rank, run.world_size, state,
                [corpus.tokenizer_path, *_hf_files(config)], config.keep_checkpoints,  # state.json holds the config
            )


def rank_planner_states(state: dict[str, Any], rank: int, world_size: int) -> list[dict[str, Any]]:
    """This rank's planners as the checkpoint saved them. Every rank saves its own: a search in
    progress holds the rank's own trial times (the slowest rank's are agreed only at a round's end),
    and each expert group settles on its own; a state saved with another world size gives rank 0's,
    and one saved before the ranks' states were kept its one list (``planners``, rank 0's)."""
    by_rank = state.get("planners_by_rank")
    if by_rank is None and "planners_by_rank_block" in state:  # a pipelined run's: each block's first holder's
        first = first_holders_planners(saved_planners_by_block(state))
        return [first[block] for block in sorted(first)]
    if by_rank is None:
        return state.get("planners", [])
    return by_rank[rank] if len(by_rank) == world_size else by_rank[0]


def saved_planners_by_block(state: dict[str, Any]) -> list[dict[int, Any]]:
    """A pipelined run's planners, each rank's by block (state.json keeps the blocks as strings)."""
    return [{int(block): planned for block, planned in held.items()} for held in state["planners_by_rank_block"]]


def first_holders_planners(by_rank: list[dict[int, Any]]) -> dict[int, Any]:
    """Each block's planner from the lowest rank that holds it."""
    first: dict[int, Any] = {}
    for held in by_rank:
        first = {**held, **first}
    return first


def _hf_files(config: TrainConfig) -> list[Path]:
    """A --hf run's checkpoints keep the source's config, so that they export on their own."""
    if config.hf is None:
        return []
    from moeflow.training.hf_export import hf_checkpoint_files

    return hf_checkpoint_files(config.hf)


def _show_progress(progress: Any, run: _Run, record: dict[str, Any]) -> None:
    postfix = {"loss": f"{run.last_loss:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if run.val_loss is not None:
        postfix["val"] = f"{run.val_loss:.3f}"
    progress.set_postfix(postfix, refresh=False)
    progress.update(1)


def _summary(run: _Run, last_step: int, hf_checkpoint: Path | None) -> dict[str, Any]:
    corpus = run.job.corpus
    return {
        "steps": last_step, "workers": run.world_size, "ep_size": run.model.groups.size,
        "loss": run.last_loss, "val_loss": run.val_loss,
        "unigram_entropy": corpus.unigram_entropy, "unigram_val_loss": corpus.unigram_val_loss,
        "median_tokens_per_s": statistics.median(run.throughput) if run.throughput else None,
        "checkpoint": str(run.checkpoint) if run.checkpoint else None, "run_dir": str(Path(run.job.run_dir)),
        "skipped_steps": run.nonfinite.skipped,
        **({"hf_checkpoint": str(hf_checkpoint)} if hf_checkpoint is not None else {}),
    }


def train_worker(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """Train (or continue) the run; rank 0 returns the run's summary."""
    run, start_step = _start_run(rank, world_size, job)
    run.model.train()
    run.model.clock.enabled = True
    progress = progress_bar(run.config, rank, start_step)
    last_step = run.config.stop_at or run.config.steps
    try:
        for step in range(start_step + 1, last_step + 1):
            with run.ledger.at(step=step, phase="training"):
                record = _train_step(run, step)
                _evaluate_log_checkpoint(run, step, last_step, record)
            _show_progress(progress, run, record)
            for alert in record.get("alerts", []) if run.rank == 0 else []:  # said once, above the bar
                progress.write(f"moeflow train: warning: {alert['message']}", file=sys.stderr)
    finally:
        progress.close()
        run.model.groups.worker.shutdown()  # its thread ends before the process groups do
        if run.log is not None:
            run.log.close()
        if run.monitor is not None:
            run.monitor.close()  # its hooks, and rank 0's sinks
        for sink in run.sinks:
            sink.close()
    hf_checkpoint = _save_hf(run) if run.config.hf is not None and last_step == run.config.steps else None
    return _summary(run, last_step, hf_checkpoint)


def _save_hf(run: _Run) -> Path:
    """The fine-tuned model as a transformers directory, exported by rank 0 from the last sharded
    checkpoint one layer at a time (no rank gathers the experts)."""
    from moeflow.training.hf_export import export_hf

    destination = Path(run.job.run_dir) / HF_CHECKPOINT
    assert run.config.hf is not None and run.checkpoint is not None
    if run.rank == 0:
        export_hf(run.checkpoint, destination, Path(run.config.hf))
    return destination


