"""The dispatcher protocol: how one layer call's tokens reach the experts that compute them and
come back (cf. Megatron-Core's ``MoETokenDispatcher``).

Once the ranks agree the load (:mod:`moeflow.parallel.agreement`), one dispatcher runs the call:

- :class:`~moeflow.parallel.dispatchers.capacity.CapacityDispatcher`: encode into an (E, C, M) buffer, the
  schedule's exchange (padded or ragged, pipelined over capacity chunks), decode; every forward
  that no other dispatcher takes;
- :class:`~moeflow.parallel.dispatchers.local.LocalDispatcher`: every expert on this rank, no backward,
  nothing dropped: the tokens stay home and skip the buffer;
- :class:`~moeflow.parallel.dispatchers.packed.PackedDispatcher`: one rank under the ragged kernel, with a
  backward: the capacity path's slots, packed;
- :class:`~moeflow.parallel.dispatchers.gathered.GatheredDispatcher`: a decode-sized no-grad forward under
  expert parallelism whose tokens came with the agreement;
- :class:`~moeflow.parallel.dispatchers.rows.RowDispatcher`: a small no-grad forward under expert
  parallelism: only the routed rows, in one ragged all-to-all each way.

Which one runs is the schedule's declaration (``ParallelSchedule.direct_path``) and the agreement's
(:func:`moeflow.parallel.dispatchers.choice.agree`); the layer calls whichever it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from moeflow.core.routing.router import Routing
from moeflow.core.stats import RoutingStats
from moeflow.kernels.choice import KernelChoice
from moeflow.parallel.agreement import GlobalLoad


@dataclass(frozen=True)
class DispatchCall:
    """One layer call as a dispatcher sees it, once routed: this rank's tokens and their routing,
    the call's k and capacity factor, the kernels it runs, and whether it is activation
    checkpointing's recompute (which repeats its forward's plan and counts nothing)."""

    x_TM: torch.Tensor
    routing: Routing
    top_k: int
    capacity_factor: float
    kernels: KernelChoice
    recompute: bool = False


@dataclass(frozen=True)
class Dispatched:
    """A dispatcher's result: the routed experts' output (T, M) and the call's statistics (a
    callable: computed on first read; None on a recompute, which reports nothing twice)."""

    y_TM: torch.Tensor
    stats: RoutingStats | Callable[[], RoutingStats] | None


class Dispatcher(Protocol):
    """Runs one layer call's routed tokens through the experts and back, on the agreed load."""

    def run(self, call: DispatchCall, load: GlobalLoad) -> Dispatched: ...
