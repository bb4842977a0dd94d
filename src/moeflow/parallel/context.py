"""What one ``ParallelSchedule.run`` receives besides the plan and the dispatched buffer, and what
it gives back.

The layer builds a :class:`RunContext` once per forward, after the load is agreed and the plan
chosen; every schedule reads what it needs from it and nothing else (no schedule is handed extra
arguments by name). A schedule that wraps another (FasterMoE's shadowing, EPLB's slots) hands its
inner schedule a context of its own with :func:`dataclasses.replace`: other experts, other counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.config import EXACT_WIRE, MoEConfig
from moeflow.core.experts import ExpertCompute, FFNWeights, LocalExperts
from moeflow.core.slot_map import SlotMap
from moeflow.core.stats import PipelineTiming
from moeflow.core.workspace import Workspace
from moeflow.kernels.ragged import RaggedFFNCompute
from moeflow.parallel.placement import ExpertPlacement


@dataclass(frozen=True)
class Prepared:
    """What a schedule derives once per forward from the agreed load, before the plan is chosen:
    the per-expert capacity whose region the planner prices (the exchanged buffer's bytes), and
    whatever its run needs of the same derivation (EPLB's replica routes), handed back to it in
    :attr:`RunContext.prepared` so that nothing is derived twice."""

    capacity: int
    state: object | None = None


@dataclass(frozen=True)
class RunContext:
    """One forward's inputs to a schedule, frozen: nothing is kept between two runs.

    ``filled_WE``: every rank's kept tokens (after capacity) per column of the exchanged buffer,
    the same on every rank; ``local`` names the columns this rank's experts compute, in local
    order (for the layer's own experts, the placement's; for EPLB's slots, the rank's slots)."""

    experts: LocalExperts  # this rank's experts as stored (their weights in the parameters' dtype)
    dtype: torch.dtype  # the dtype the experts compute in (autocast's or x's)
    groups: ParallelGroups
    placement: ExpertPlacement
    timing: PipelineTiming
    workspace: Workspace | None  # None: plain allocations (a no-grad forward)
    filled_WE: torch.Tensor
    local: tuple[int, ...]
    capacity: int
    kernel: str  # this call's expert kernel: "bmm", "loop" or "ragged" (expert_kernel="auto" resolved)
    backend: str  # the resolved kernel backend of the ragged kernel
    estimate_E: np.ndarray | None = None  # an inference hook's estimated selections, summed over ranks
    prepared: object | None = None  # the schedule's own Prepared.state of this forward
    wire_dtype: str = EXACT_WIRE  # how the exchanged rows travel (moeflow.comm.wire)
    slots: SlotMap | None = None  # the dispatched buffer's slot map (which token each slot holds), where known
    weights_TK: torch.Tensor | None = None  # the gate weights of the tokens it encoded, in the graph

    def slot_weights(self) -> torch.Tensor | None:
        """(E * C,): each slot's gate weight in the compute dtype, in the graph (0: an empty slot);
        derived when a schedule asks (the dedup exchange applies them where the experts run)."""
        if self.slots is None or self.weights_TK is None:
            return None
        kept_N = self.weights_TK.flatten().index_select(0, self.slots.choice_idx_N)
        return self.slots.per_slot(kept_N.to(self.dtype))

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.size

    def weights(self) -> FFNWeights:
        """The local experts' weights in the compute dtype, cast in the graph."""
        return self.experts.weights().cast(self.dtype)

    def received_compute(self, first: int, block: int) -> ExpertCompute:
        """The compute of the local experts on the slots they receive from ranks ``first`` to
        ``first + block``: the ragged kernel on the filled ones, or the padded experts."""
        return self.compute_on(self.filled_WE[first: first + block, list(self.local)].t())

    def own_compute(self, columns: Sequence[int]) -> ExpertCompute:
        """The compute of ``columns`` run here on this rank's own tokens only."""
        return self.compute_on(self.filled_WE[self.rank, list(columns)].unsqueeze(1))

    def compute_on(self, filled_LW: torch.Tensor) -> ExpertCompute:
        """The ragged kernel over the filled slots ``filled_LW`` (local expert x source rank) when the
        layer runs it or no backward will run (a dropless evaluation or generation pads every expert
        to the fullest one: padded, its transient buffers were the evaluation's peak), else the
        padded experts' own compute."""
        if self.kernel != "ragged" and torch.is_grad_enabled():
            return self.experts.compute
        return RaggedFFNCompute(
            self.experts.compute, filled_LW.contiguous(), keeps_activations=torch.is_grad_enabled(),
            backend=self.backend,
        )


def layer_context(
    experts: LocalExperts, placement: ExpertPlacement, groups: ParallelGroups, config: MoEConfig,
    local: tuple[int, ...], dtype: torch.dtype, timing: PipelineTiming, filled_WE: torch.Tensor, capacity: int,
    backend: str, estimate_E: np.ndarray | None = None, prepared: object | None = None,
    workspace: Workspace | None = None, slots: SlotMap | None = None, weights_TK: torch.Tensor | None = None,
    kernel: str | None = None,
) -> RunContext:
    """What a layer's schedule runs with: its experts over its placement (``local``: this rank's
    experts' global indices), the call's expert kernel (``kernel``, else the layer's setting) and the
    layer's wire setting, the kept counts (and, where the caller has the gathered buffer's slot map
    and gate weights, each slot's token and weight)."""
    return RunContext(experts, dtype, groups, placement, timing, workspace, filled_WE, local, capacity,
                      config.expert_kernel if kernel is None else kernel, backend, estimate_E, prepared,
                      config.wire_dtype, slots, weights_TK)


@dataclass(frozen=True)
class ScheduleOutput:
    """The combined (E, C, M) buffer and what the schedule reports about its run: the assignments
    each rank's experts computed (empty when a schedule does not count them), FasterMoE's
    shadowed experts with the gain its cost model predicted for them, the rows its dispatch
    sent across nodes (the combine sends them back) and those a dedup exchange did not send."""

    combined_ECM: torch.Tensor
    rank_tokens: tuple[int, ...] = ()
    shadowed_experts: tuple[int, ...] = ()
    shadow_predicted_gain_s: float | None = None
    cross_node_rows: int | None = None  # token rows the dispatch sent between nodes, all ranks (None: not counted)
    dedup_saved_rows: int | None = None  # rows the dispatch did not send (a token's copies to one rank); None: no dedup
    dedup_totals: Callable[[], tuple[int, int]] | None = None  # a dedup exchange's (saved, cross-node) rows, read later
    weighted: bool = False  # combined_ECM's rows carry their gate weights (summed before they travelled): decode sums
