"""Lina's expert packing in training (§4.2, §5): starting from expert parallelism, double the experts
each worker holds while an expert micro-op (one capacity chunk's expert compute) is shorter than an
all-to-all micro-op (one chunk's exchange), so that the pipeline's compute fills its communication.
Decided from the times measured since the last decision, after a warm-up, and revisited every few
steps (Lina: from step 10, every 4 steps); once a doubling no longer pays, the packing stays.

A packed layer holds every expert in each block of E / k workers (its all-to-alls stay inside the
block) and the blocks' copies of an expert average their gradients like any replicated weight
(:meth:`moeflow.parallel.placement.ExpertPlacement.packed`). ``--expert-packing N`` holds N experts
per worker from the first step. The packer's state goes into checkpoints: a resumed run packs its
layers as they were before it measures again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.groups import group_size, max_over_ranks
from moeflow.comm.traffic import AllToAllTraffic
from moeflow.config import MoEConfig
from moeflow.models import TrainableLM
from moeflow.moe.layer import MoELayer
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.registry import check_techniques
from moeflow.parallel.schedules import packed_schedule

PACKING_MODES = ("off", "auto")
"""--expert-packing: off, auto (Lina's doubling), or an int (experts per worker, fixed)."""


@dataclass(frozen=True)
class MicroOpTimes:
    """A step's mean expert micro-op and all-to-all micro-op on this worker (seconds)."""

    expert_s: float
    alltoall_s: float


@dataclass
class TrafficMark:
    """The all-to-all counters of a job's traffic when a step began."""

    seconds: float
    ops: int

    @classmethod
    def of(cls, traffic: AllToAllTraffic) -> TrafficMark:
        return cls(traffic.alltoall_seconds, traffic.alltoall_ops)


def micro_op_times(model: TrainableLM, began: TrafficMark) -> MicroOpTimes | None:
    """The step's expert compute per capacity chunk (forward and backward, every MoE layer) and its
    all-to-all time per exchange since ``began``; None when no all-to-all ran."""
    traffic = model.groups.traffic
    ops = traffic.alltoall_ops - began.ops
    expert_s, chunks = 0.0, 0
    for layer in model.moe_layers():
        stats = layer.last_stats
        if stats is None or stats.plan is None:
            continue
        expert_s += stats.timing.expert_total_s
        chunks += stats.plan.pipeline_degree * (2 if stats.timing.backward_s is not None else 1)
    if ops <= 0 or chunks == 0:
        return None
    return MicroOpTimes(expert_s / chunks, (traffic.alltoall_seconds - began.seconds) / ops)


@dataclass
class ExpertPacker:
    """Every MoE layer's experts per worker, and when to double it.

    ``mode``: ``"auto"`` or a fixed number of experts per worker. ``experts_per_rank`` is what the
    layers hold (None: as built, expert parallel). ``settled``: auto found that packing no longer
    pays, or could not pack further."""

    mode: str | int
    warmup: int = 10
    interval: int = 4
    experts_per_rank: int | None = None
    settled: bool = False
    window: list[MicroOpTimes] = field(default_factory=list)
    replicas: dist.ProcessGroup | None = None  # --ep-size: the expert groups' copies, which must pack alike

    def start(self, model: TrainableLM, optimizer: torch.optim.Optimizer) -> None:
        """A fixed packing from the first step (a collective)."""
        if isinstance(self.mode, int):
            self._pack(model, optimizer, self.mode)

    def record(self, times: MicroOpTimes | None) -> None:
        if times is not None and self.mode == "auto" and not self.settled:
            self.window.append(times)

    def step(self, step: int, model: TrainableLM, optimizer: torch.optim.Optimizer) -> bool:
        """After ``step``'s update, on a decision step: double the experts per worker if the slowest
        worker's mean expert micro-op was shorter than its all-to-all micro-op; return whether the
        layers were packed (a collective on decision steps: every worker decides the same)."""
        if self.mode != "auto" or self.settled or step < self.warmup or (step - self.warmup) % self.interval:
            return False
        window, self.window = self.window, []
        count = max(len(window), 1)
        means = [sum(t.expert_s for t in window) / count, sum(t.alltoall_s for t in window) / count,
                 float(len(window))]
        groups = model.groups
        if groups.size > 1:
            means = max_over_ranks(means, groups.expert, groups.ledger)
        if group_size(self.replicas) > 1:  # every copy of the expert group decides on the slowest
            means = max_over_ranks(means, self.replicas, groups.ledger)
        expert_s, alltoall_s, measured = means
        if not measured:  # no all-to-all ran (every expert already on every worker)
            return False
        wider = _doubled(self.experts_per_rank or model.moe_layers()[0].experts_per_rank, model)
        if wider is None or expert_s >= alltoall_s:
            self.settled = True
            return False
        self._pack(model, optimizer, wider)
        return True

    def state(self) -> dict[str, Any]:
        return {"experts_per_rank": self.experts_per_rank, "settled": self.settled}

    def restore(self, state: dict[str, Any], model: TrainableLM, optimizer: torch.optim.Optimizer) -> None:
        """Back to a checkpoint's packing (a collective). A packing this number of workers cannot
        hold (the run was resharded) starts over from expert parallelism."""
        saved = state.get("experts_per_rank")
        self.settled = bool(state.get("settled", False))
        if saved is None:
            return
        try:
            self._pack(model, optimizer, int(saved))
        except ValueError:
            self.experts_per_rank, self.settled = None, False

    def _pack(self, model: TrainableLM, optimizer: torch.optim.Optimizer, experts_per_rank: int) -> None:
        for layer in model.moe_layers():
            pack_layer(layer, experts_per_rank, optimizer)
        self.experts_per_rank = experts_per_rank


def _doubled(experts_per_rank: int, model: TrainableLM) -> int | None:
    """Twice the experts per worker, if every layer can hold that many (blocks of E / 2k workers)."""
    wider = 2 * experts_per_rank
    for layer in model.moe_layers():
        num_experts = layer.config.num_experts
        if wider > num_experts or num_experts % wider or layer.world_size % (num_experts // wider):
            return None
    return wider


def parse_packing(value: str | int) -> str | int:
    """``--expert-packing``'s value: off, auto, or a positive number of experts per worker."""
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        number = int(value)
        if number < 1:
            raise ValueError(f"expert_packing must be off, auto or a number of experts per worker >= 1, got {value!r}")
        return number
    if value not in PACKING_MODES:
        raise ValueError(f"expert_packing must be off, auto or a number of experts per worker, got {value!r}")
    return value


def check_packing(config: MoEConfig, schedule: str, world_size: int, experts_per_rank: int) -> None:
    """Packing re-places an expert-parallel layer: ``experts_per_rank`` must be a multiple of E / W
    that divides E, and the registry's combination rules must allow it beside the layer's features."""
    least = config.num_experts // world_size
    check_techniques(config, schedule, applied=("expert packing",))
    if world_size > config.num_experts:
        raise ValueError(f"expert packing re-places the expert-parallel schedule with W <= E; this layer has "
                         f"{config.num_experts} experts on {world_size} ranks: use parallel='expert' with W <= E")
    if experts_per_rank < least or config.num_experts % experts_per_rank or world_size % (
            config.num_experts // experts_per_rank):
        raise ValueError(f"experts_per_rank={experts_per_rank} cannot pack {config.num_experts} experts on "
                         f"{world_size} ranks: use a multiple of {least} that divides {config.num_experts}")


def pack_layer(layer: MoELayer, experts_per_rank: int, optimizer: torch.optim.Optimizer | None = None) -> bool:
    """Lina's expert packing of one layer: hold ``experts_per_rank`` experts on every rank, in
    blocks of E / experts_per_rank ranks that each hold all experts (their all-to-alls stay inside
    the block), moving the weights and the optimizer state once; return whether the placement
    changed (a collective). E / W experts per rank is expert parallelism again."""
    config = layer.config
    check_packing(config, layer.schedule.name, layer.world_size, experts_per_rank)
    group_size = config.num_experts // experts_per_rank
    placement = ExpertPlacement.packed(config.num_experts, layer.world_size, group_size, config.hidden_dim)
    if placement == layer.placement:
        return False
    layer.switch(packed_schedule(group_size, layer.world_size), placement, optimizer)
    return True
