"""``moeflow bench contention``: MoE all-to-alls against the gradient all-reduce on an emulated
cluster, Lina §2.2 and §7.2 scaled down (the all-reduce and the all-to-all share the node links).

Two kinds of point, every rank one core:

- ``links``: the backward of ``layers`` MoE layers, each a combine (compute), an all-to-all, the
  experts (compute), an all-to-all and attention (compute), with ``allreduce_mb`` of gradients to
  all-reduce. Modes: ``alone`` (no all-reduce: the floor), ``beside`` (one all-reduce of every
  gradient launched at the start, as when a large bucket is ready), ``overlap`` (DDP-style buckets
  of ``bucket_mb``) and ``lina`` (micro-ops of ``microop_mb`` that yield to the all-to-alls). Per
  mode, medians over rounds: the round's all-to-all seconds (rank 0's timeline; a sum, since only
  the all-to-alls an all-reduce meets are slowed) and the slowest rank's time until the last
  all-reduce is done.
- ``step``: training steps of a model (``default``: the trainer's; ``large``: wider, with four
  times the replicated parameters; both with a fixed plan, pipeline degree 2 and the linear
  all-to-all, so that no online planner trial lands in one mode's steps) under ``--grad-sync``
  after, overlap and lina, each its own copy of the same weights, round-robin: the slowest
  rank's step time and the all-to-all time beside an all-reduce, medians after warm-up steps.
- ``packing``: the same steps under --grad-sync lina with Lina's expert packing off (expert
  parallel) and at every number of experts per worker its doubling reaches (blocks of fewer
  workers holding every expert), with the expert and all-to-all micro-op times its packer reads.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from moeflow.comm.collectives import all_reduce
from moeflow.progress import Progress

LINA_ALLTOALL_GOAL = 1.1  # Lina's all-to-all at most this much slower than alone
LINK_MODES = ("alone", "beside", "overlap", "lina")
STEP_MODES = ("after", "overlap", "lina")
MODELS: dict[str, dict[str, Any]] = {
    "default": {},
    "large": {"model_dim": 512, "hidden_dim": 1024, "heads": 8, "vocab_size": 8192, "batch_size": 8},
}
FIXED_PLAN = {"pipeline": 2, "alltoall": "linear"}  # the planner's online trials would time differently per mode
MEGABYTE = 1 << 20


@dataclass(frozen=True)
class ContentionPoint:
    kind: str  # "links", "step" or "packing"
    model: str = "default"  # step: a key of MODELS
    layers: int = 4  # links: MoE layers in the backward
    alltoall_mb: float = 5.0  # links: each rank's all-to-all buffer (the default model's per layer)
    allreduce_mb: float = 8.0  # links: the replicated gradients (the default model's)
    compute_ms: float = 8.0  # links: the experts' and attention's backward, each
    microop_mb: float = 1.0
    bucket_mb: float = 1.0
    steps: int = 5  # step: timed steps per mode (after one untimed)

    @property
    def name(self) -> str:
        if self.kind in ("step", "packing"):
            return f"{self.kind}-{self.model}-op{self.microop_mb:g}MB"
        return f"links-L{self.layers}-a2a{self.alltoall_mb:g}MB-ar{self.allreduce_mb:g}MB-op{self.microop_mb:g}MB"


def _busy(milliseconds: float) -> None:
    """Compute on this rank's core for about ``milliseconds`` (small matmuls, like a backward)."""
    import torch

    a = torch.randn(128, 128)
    deadline = time.perf_counter() + milliseconds / 1e3
    while time.perf_counter() < deadline:
        a @ a


def _layer_backwards(point: ContentionPoint, groups: Any, buffer: Any) -> None:
    """What the all-to-alls of ``point.layers`` MoE layers' backward look like to the links."""
    from moeflow.comm.algorithms import exchange

    for _ in range(point.layers):
        groups.traffic.expect()  # the combine's backward begins
        _busy(point.compute_ms / 4)
        exchange("linear", buffer, groups)
        _busy(point.compute_ms)  # the experts' backward
        exchange("linear", buffer, groups)
        groups.traffic.settle()
        _busy(point.compute_ms)  # attention's backward


def _measure_links(point: ContentionPoint, groups: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.timing.measure import slowest_rank_seconds
    from moeflow.training.grad_sync import gradient_scheduler

    world = dist.get_world_size()
    own_group = dist.new_group(list(range(world)))
    buffer = torch.randn(world, int(point.alltoall_mb * MEGABYTE) // 4 // world)
    grads = [torch.nn.Parameter(torch.zeros(int(point.allreduce_mb * MEGABYTE) // 4 // 8)) for _ in range(8)]
    schedulers = {mode: gradient_scheduler(mode, grads, own_group, world, groups.traffic, point.microop_mb,
                                           point.bucket_mb) for mode in ("overlap", "lina")}
    flat = torch.zeros(int(point.allreduce_mb * MEGABYTE) // 4)

    def run(mode: str) -> None:
        scheduler = schedulers.get(mode)
        if scheduler is not None:
            scheduler.start()
            sum(g.sum() for g in grads).backward()  # every gradient ready at once
        work = all_reduce(flat, own_group, async_op=True) if mode == "beside" else None
        _layer_backwards(point, groups, buffer)
        if scheduler is not None:
            scheduler.finish()
            for g in grads:
                g.grad = None
        if work is not None:
            work.wait()

    samples: dict[str, list[float]] = {mode: [] for mode in LINK_MODES}
    alltoalls: dict[str, list[float]] = {mode: [] for mode in LINK_MODES}
    groups.traffic.timeline.enabled = True
    for round_index in range(repeats + 1):  # round 0 warms up
        for mode in LINK_MODES:
            groups.traffic.timeline.take()
            seconds = slowest_rank_seconds(lambda mode=mode: run(mode))
            events = groups.traffic.timeline.take()
            if round_index:
                samples[mode].append(seconds)
                alltoalls[mode].append(sum(e.seconds for e in events if e.kind == "alltoall"))
    groups.traffic.timeline.enabled = False
    if dist.get_rank() == 0:
        _emit_links(point, samples, alltoalls, emit)


def _emit_links(point: ContentionPoint, samples: dict[str, list[float]], alltoalls: dict[str, list[float]],
                emit: Any) -> None:
    alltoall = {mode: statistics.median(values) for mode, values in alltoalls.items()}
    total = {mode: statistics.median(values) for mode, values in samples.items()}
    for mode in LINK_MODES:
        emit({"bench": "contention-links", "config": point.name, **asdict(point), "mode": mode,
              "alltoall_ms_per_round": alltoall[mode] * 1e3, "until_allreduced_ms": total[mode] * 1e3})
    emit({
        "bench": "contention-links-compare", "config": point.name,
        **{f"alltoall_{mode}_over_alone": alltoall[mode] / alltoall["alone"] for mode in LINK_MODES[1:]},
        **{f"total_{mode}_over_alone": total[mode] / total["alone"] for mode in LINK_MODES[1:]},
    })


def step_config(model: str, **changes: Any) -> Any:
    """The trainer's settings of a ``step`` point's model."""
    from moeflow.training.config import TrainConfig

    return replace(TrainConfig(), **{**MODELS[model], **FIXED_PLAN, "progress": False, **changes})


def step_modes(point: ContentionPoint, world_size: int) -> dict[str, dict[str, Any]]:
    """The trainer settings each mode of a point changes: ``step``, the --grad-sync modes (the first
    is the baseline); ``packing``, expert parallelism and every packing Lina's doubling can reach,
    all under --grad-sync lina."""
    if point.kind == "step":
        return {mode: {"grad_sync": mode} for mode in STEP_MODES}
    num_experts = step_config(point.model).num_experts
    # expert parallel, measuring the micro-ops Lina's packer would decide on, but never packing
    modes = {"expert": {"grad_sync": "lina", "expert_packing": "auto", "packing_warmup": 1 << 30}}
    per_worker = 2 * num_experts // world_size
    while (per_worker <= num_experts and num_experts % per_worker == 0
           and world_size % (num_experts // per_worker) == 0):
        modes[f"packed{per_worker}"] = {"grad_sync": "lina", "expert_packing": str(per_worker)}
        per_worker *= 2
    return modes


def _measure_steps(point: ContentionPoint, groups: Any, repeats: int, emit: Any) -> None:
    """Training steps per mode, round-robin, each mode its own copy of the same weights."""
    import torch.distributed as dist

    from moeflow.timing.measure import slowest_rank_seconds
    from moeflow.training.trainer import _train_step

    modes = step_modes(point, dist.get_world_size())
    runs = {mode: _bench_run(point, groups, changes) for mode, changes in modes.items()}
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    records: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for step in range(1, point.steps + 2):  # step 1 warms up (and lets the planners settle)
        for mode, run in runs.items():
            done: list[dict[str, Any]] = []
            seconds = slowest_rank_seconds(lambda run=run, step=step, done=done: done.append(_train_step(run, step)))
            if step > 1:
                samples[mode].append(seconds)
                records[mode].append(done[0])
    if dist.get_rank() != 0:
        return
    step_s = {mode: statistics.median(values) for mode, values in samples.items()}
    for mode in modes:
        emit({"bench": f"contention-{point.kind}", "config": point.name, "model": point.model, "mode": mode,
              "step_ms": step_s[mode] * 1e3, **_median_comm_ms(records[mode]),
              "replicated_mb": _replicated_mb(runs[mode])})
    baseline = next(iter(modes))
    emit({"bench": f"contention-{point.kind}-compare", "config": point.name,
          **{f"{mode}_speedup_over_{baseline}": step_s[baseline] / step_s[mode] for mode in list(modes)[1:]}})


def _median_comm_ms(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians (ms) of the steps' all-to-all time alone and beside an all-reduce, and under packing
    the micro-op times Lina's packer decides on."""
    import numpy as np

    def median_ms(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return float(np.median(present)) * 1e3 if present else None

    medians = {"alltoall_alone_ms": median_ms([r["comm_s"]["all_to_all_alone"] for r in records]),
               "alltoall_beside_allreduce_ms": median_ms([r["comm_s"]["all_to_all_with_allreduce"] for r in records]),
               "allreduce_ms": median_ms([r["comm_s"]["allreduce"] for r in records])}
    if "packing" in records[0]:
        medians |= {f"{key}_ms": median_ms([r["packing"][f"{key}_s"] for r in records])
                    for key in ("expert_op", "alltoall_op")}
    return medians


def _bench_run(point: ContentionPoint, groups: Any, changes: dict[str, Any]) -> Any:
    """The trainer's per-worker state for one mode (random tokens stand in for a corpus)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from moeflow.models import MoETransformer
    from moeflow.training.optimizer import build_optimizer
    from moeflow.training.trainer import Job, _copy_groups, _copy_scheduler, _gradient_scheduler, _packer, _Run

    config = step_config(point.model, microop_mb=point.microop_mb, bucket_mb=point.bucket_mb,
                         workers=dist.get_world_size(), **changes)
    model = MoETransformer(config.model_config(config.vocab_size), group=groups, seed=config.seed)
    tokens = np.random.default_rng(dist.get_rank()).integers(0, config.vocab_size, 1 << 16, dtype=np.int64)
    optimizer = build_optimizer(model, config)
    run = _Run(Job(config, None, ""), dist.get_rank(), dist.get_world_size(), torch.device("cpu"),  # type: ignore[arg-type]
               dist.group.WORLD, model, optimizer, tokens, tokens, None, expert_names=model.expert_parameter_names(),
               packer=_packer(config, model, optimizer, None, None))
    run.copy_groups = _copy_groups(run)
    run.grad_scheduler, run.copy_scheduler = _gradient_scheduler(run), _copy_scheduler(run)
    model.train()
    model.clock.enabled = True
    groups.traffic.timeline.enabled = True
    return run


def _replicated_mb(run: Any) -> float:
    from moeflow.training.gradients import replicated_parameters

    return sum(p.numel() * p.element_size() for p in replicated_parameters(run.model, run.expert_names)) / MEGABYTE


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    def measure(values: dict[str, Any], groups: Any, profile: Any, repeats: int, emit: Any) -> None:
        point = ContentionPoint(**values)
        (_measure_links if point.kind == "links" else _measure_steps)(point, groups, repeats, emit)

    grid_rank_main(argv, "contention", measure)


def run(
    grid: list[ContentionPoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29795, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster (no calibration: nothing here plans), run the grid, return rank
    0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.contention", "contention", grid, nodes, ranks_per_node, inter_gbit,
                          repeats, profile, master_port, timeout_s, calibrate=False, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Lina's all-to-all against alone (the goal), and each mode's step-time speedup over after."""
    links = [r for r in records if r.get("bench") == "contention-links-compare"]
    steps = [r for r in records if r.get("bench") == "contention-step-compare"]
    packing = [r for r in records if r.get("bench") == "contention-packing-compare"]
    worst = max((r["alltoall_lina_over_alone"] for r in links), default=None)
    return {
        "summary": "contention",
        "alltoall_beside_over_alone": {r["config"]: r["alltoall_beside_over_alone"] for r in links},
        "alltoall_lina_over_alone": {r["config"]: r["alltoall_lina_over_alone"] for r in links},
        "lina_alltoall_goal_met": None if worst is None else worst <= LINA_ALLTOALL_GOAL,
        "step_speedup_over_after": {r["config"]: {m: r[f"{m}_speedup_over_after"] for m in STEP_MODES[1:]}
                                    for r in steps},
        "packing_speedup_over_expert": {r["config"]: {k.removesuffix("_speedup_over_expert"): v for k, v in r.items()
                                                       if k.endswith("_speedup_over_expert")} for r in packing},
        "lina_fastest": all(r["lina_speedup_over_after"] >= r["overlap_speedup_over_after"]
                            and r["lina_speedup_over_after"] >= 1 for r in steps) if steps else None,
    }


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
