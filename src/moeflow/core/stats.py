"""What one MoE forward did: load per expert, drops, capacity and the execution plan.

Dropped tokens are never silent: every forward fills a :class:`RoutingStats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PipelineTiming:
    """Wall-clock seconds of the pipelined dispatch -> experts -> combine region on this rank: the
    forward fills ``forward_s``, the backward (when one runs) ``backward_s``. The ``expert_*``
    fields hold the part of each spent computing the experts on the caller's thread; the rest is
    communication the pipeline did not hide. ``gather_s`` is the collectives a schedule runs outside
    the pipeline in the forward (Tutel's weight all-gathers, Parm S1's token all-gather); their
    backward counterparts (reduce-scatters, the split's all-gather) count in ``backward_s``.

    On CUDA the host only queues the work. For a planner trial the layer sets ``synced_device``:
    the region's bounds (:meth:`now`) then wait for that device, so the trial compares device time,
    not the time to queue it. The ``expert_*`` fields stay host time there (waiting per chunk would
    undo the overlap being measured)."""

    forward_s: float | None = None
    backward_s: float | None = None
    expert_forward_s: float = 0.0
    expert_backward_s: float = 0.0
    gather_s: float = 0.0
    synced_device: str | None = None

    def now(self) -> float:
        """The clock of a region's bounds (after the device's queued work, on a synced trial)."""
        if self.synced_device is not None:
            import torch  # only here: the planner and perf modules import this one with numpy alone

            torch.cuda.synchronize(self.synced_device)
        return time.perf_counter()

    @property
    def total_s(self) -> float:
        return (self.forward_s or 0.0) + (self.backward_s or 0.0) + self.gather_s

    @property
    def expert_total_s(self) -> float:
        return self.expert_forward_s + self.expert_backward_s


def max_over_mean(values: Sequence[float]) -> float:
    """The largest of ``values`` over their mean: how far the busiest expert (or rank) runs over a
    balanced load (1.0 when even, empty or all zero)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


def region_clock(timing: PipelineTiming | None) -> float:
    """``timing.now()``, or the host clock where no timing is kept."""
    return time.perf_counter() if timing is None else timing.now()


@dataclass(frozen=True)
class ExecutionPlan:
    """How one forward ran the experts, and why: the schedule, the all-to-all, the pipeline degree
    (``pipeline_degree`` chunks really ran, ``requested_degree`` was asked for), the planner policy
    and the source of the choice (forced, model, warmup, trial, settled or local), its capacity bucket,
    the predicted seconds when a profile was given, and what the search that settled the plan spent
    over running it throughout (``trial_cost_s``, the slowest rank's). ``slots`` is the slots per expert of the
    buffer this rank sent: the capacity, or under Parm's S1 this MP member's packed share."""

    schedule: str
    alltoall: str
    pipeline_degree: int
    requested_degree: int
    policy: int | str
    source: str
    world_size: int
    expert_kernel: str
    capacity_key: int | None = None
    r: int | None = None  # Tutel's r under the adaptive schedule
    predicted_forward_s: float | None = None
    predicted_backward_s: float | None = None
    predicted_gradient_sync_s: float | None = None
    trial_cost_s: float | None = None
    slots: int | None = None
    token_exchange: str = "padded"  # how the tokens travelled: every slot, or the kept rows ("ragged")
    kernels: dict[str, str] = field(default_factory=dict)  # who ran encode, decode, the GEMMs (KernelChoice.as_dict)


@dataclass(frozen=True)
class RoutingStats:
    """Global (all ranks of the group) routing statistics of the last forward.

    A token with top-k routing makes k assignments; counts are of assignments. ``dropped`` is the
    number of assignments beyond capacity (they contribute zero to the output).
    """

    num_tokens: int
    top_k: int
    capacity: int
    capacity_factor: float  # the requested setting (>0 fixed, 0 no-drop, <0 capped no-drop)
    tokens_per_expert: list[int]  # assignments routed to each expert, before capacity
    dropped_per_expert: list[int]
    plan: ExecutionPlan | None = None
    timing: PipelineTiming = field(default_factory=PipelineTiming)  # measured; backward fills in later
    shadowed_experts: tuple[int, ...] = ()  # FasterMoE: computed where their tokens are this iteration
    shadow_predicted_gain_s: float | None = None  # Algorithm 1's predicted step saving (None: no profile)
    rank_tokens: tuple[int, ...] = ()  # assignments each rank's experts computed (after capacity)
    cross_node_rows: int | None = None  # token rows the dispatch sent between nodes, all ranks (None: not counted)
    dedup_saved_rows: int | None = None  # rows the dispatch did not send (a token's copies to one rank), all ranks
    dedup_saved_bytes: int | None = None  # the forward's saving on the links: those rows, dispatch and combine

    @property
    def dropped(self) -> int:
        return sum(self.dropped_per_expert)

    @property
    def rank_imbalance(self) -> float:
        """Max over mean of ``rank_tokens``: how long the slowest rank's experts run against a
        balanced load (1.0 when even or unknown)."""
        return max_over_mean(self.rank_tokens)

    @property
    def effective_capacity_factor(self) -> float:
        """The capacity actually used, as a factor of the balanced load k*T/E (Tutel Fig. 10)."""
        num_experts = len(self.tokens_per_expert)
        world = self.plan.world_size if self.plan is not None else 1
        balanced = self.top_k * self.num_tokens / (num_experts * world)
        return self.capacity / balanced if balanced else 0.0

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["dropped"] = self.dropped
        values["effective_capacity_factor"] = self.effective_capacity_factor
        values["rank_imbalance"] = self.rank_imbalance
        return values
