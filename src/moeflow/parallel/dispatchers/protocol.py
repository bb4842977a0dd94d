"""The dispatcher protocol: how one layer call's tokens reach the experts that compute them and
come back (cf. torchtitan's ``dispatch()`` / ``combine()`` pair, Megatron-Core's ``MoETokenDispatcher``).

Once the ranks agree the load (:mod:`moeflow.parallel.agreement`), one dispatcher runs the call in
three steps, which the layer's forward names one by one:

1. ``dispatcher.dispatch(call, routing, load)`` lays this rank's routed tokens out for the experts
   and returns the call's :class:`Dispatch`;
2. ``dispatch.experts(rows)`` takes the rows to the experts and back (the only step that reads the
   expert weights: the layer runs it inside ``ExpertFFN.run_with_weights``, FSDP2's seam);
3. ``dispatch.combine(rows)`` sums each token's k rows with its combine weights.

The dispatchers:

- :class:`~moeflow.parallel.dispatchers.capacity.CapacityDispatcher`: the slot gather into an (E, C, M)
  buffer, the schedule's exchange around the experts (padded or ragged, pipelined over capacity
  chunks), the scatter back; every call that no other dispatcher takes;
- :class:`~moeflow.parallel.dispatchers.local.LocalDispatcher`: every expert on this rank, no backward,
  nothing dropped: the tokens stay home and skip the buffer;
- :class:`~moeflow.parallel.dispatchers.kept_rows.PackedDispatcher`: one rank under the ragged kernel, with a
  backward: the capacity path's slots, packed;
- :class:`~moeflow.parallel.dispatchers.gathered.GatheredDispatcher`: a decode-sized no-grad forward under
  expert parallelism whose tokens came with the agreement;
- :class:`~moeflow.parallel.dispatchers.rows.RowDispatcher`: a small no-grad forward under expert
  parallelism: only the routed rows, in one ragged all-to-all each way.

The four that skip the buffer run their tokens to the experts and back in one step
(:class:`~moeflow.parallel.dispatchers.stats.DirectDispatch`): their dispatch lays out nothing and their
combine has nothing left to sum.
Which dispatcher runs is :class:`~moeflow.parallel.dispatchers.choice.Dispatchers`' choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from moeflow.core.routing.router import Routing
from moeflow.core.stats import PipelineTiming, RoutingStats
from moeflow.core.workspace import Workspace
from moeflow.kernels.choice import KernelChoice
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.online_planner import PlanChoice

Stats = RoutingStats | Callable[[], RoutingStats] | None
"""A call's statistics: computed, computed on first read (a callable), or none (a recompute)."""


@dataclass
class ForwardRecord:
    """What one forward decided that its recompute (activation checkpointing's repeat, in the
    backward) must repeat: the plan it ran, and the routing bias it routed with when the forward
    moves that bias afterwards (None: the bias stays). The layer keeps them
    (:class:`moeflow.moe.forward_memory.ForwardMemory`)."""

    bias: torch.Tensor | None = None
    plan: PlanChoice | None = None

    def planned(
        self, recompute: bool, choose: Callable[[], tuple[PlanChoice, PipelineTiming]]
    ) -> tuple[PlanChoice, PipelineTiming]:
        """``choose()``'s plan, kept here; a recompute takes its forward's plan (with a timing
        record nobody reads)."""
        if recompute and self.plan is not None:
            return self.plan, PipelineTiming()
        self.plan, timing = choose()
        return self.plan, timing


@dataclass(frozen=True)
class LayerCall:
    """One layer call's own values, which every step reads: this rank's tokens, the call's k and
    capacity factor, Tutel's r (None: the planner's), the kernels it runs, whether it is activation
    checkpointing's recompute (which repeats its forward's plan and counts nothing), that forward's
    record, the workspace of a forward whose buffers a backward uses (None: a no-grad call),
    whether the call moves the loss-free balancing bias after routing, and the layer's training mode
    (set alike on every rank by ``model.train()``, where grad mode may differ between ranks)."""

    x_TM: torch.Tensor
    top_k: int
    capacity_factor: float
    r: int | None
    kernels: KernelChoice
    recompute: bool
    record: ForwardRecord
    workspace: Workspace | None
    moves_bias: bool
    training: bool = True

    @property
    def asks_direct(self) -> bool:
        """Whether the call may skip the capacity buffer: no backward, and no selection bias to move."""
        return self.workspace is None and not self.moves_bias


class Dispatch(Protocol):
    """One call's tokens on their way: ``rows`` is what the experts' step takes."""

    rows: torch.Tensor

    def experts(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows to the experts and back."""
        ...

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Each token's output (T, M) from the rows the experts' step returned."""
        ...

    def stats(self) -> Stats:
        """What the call did (read after the combine)."""
        ...


class Dispatcher(Protocol):
    """Lays one call's routed tokens out for the experts, on the agreed load."""

    def dispatch(self, call: LayerCall, routing: Routing, load: GlobalLoad) -> Dispatch: ...
