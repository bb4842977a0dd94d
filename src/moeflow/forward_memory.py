"""What a layer keeps of its last forwards, so that the training tools people use work on it.

Activation checkpointing runs a forward again inside the backward (the *recompute*): that run
must repeat its forward exactly, or the saved tensors differ (the non-reentrant mode refuses
them) and the gradients belong to another computation. Two of the layer's choices change from
call to call: the planner's plan (it times a different candidate at each call while it searches)
and the loss-free balancing bias (each training forward moves it). So the layer keeps the plan
each region shape last ran and the bias each forward routed with, and a recompute takes them
instead of deciding again; it also counts nothing twice (no bias update, no statistics).

``aux_loss`` stays a tensor of the last graph, which ``copy.deepcopy`` cannot copy (an EMA or
teacher copy of the model taken after a forward): :class:`GraphValue` copies its value alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from moeflow.perf.pipeline import RegionShape
from moeflow.planner import PlanChoice
from moeflow.stats import PipelineTiming

#: Plans and biases a recompute can find: enough for a layer called this often in one step.
KEPT = 8


def recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recompute (both
    modes recompute in the backward; nothing else runs a layer's forward there). A compiled
    forward is never rerun that way (the compiler recomputes in its own graph), and the check
    would break its graph."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class GraphValue:
    """A tensor of the last forward's graph kept for reading; a deepcopy copies the value alone."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, object]) -> GraphValue:
        return GraphValue(self.value.detach().clone())


class ForwardMemory:
    """The plans and routing biases of a layer's last forwards, for its recomputes."""

    def __init__(self) -> None:
        self._plans: dict[RegionShape, PlanChoice] = {}  # the plan each region shape last ran, oldest first
        self._biases: list[torch.Tensor] = []  # the selection bias before each update, latest last

    def plan(
        self, region: RegionShape, recompute: bool, choose: Callable[[], tuple[PlanChoice, PipelineTiming]]
    ) -> tuple[PlanChoice, PipelineTiming]:
        """``choose()``'s plan, kept for a forward with a graph; a recompute takes the plan its
        region last ran (with a timing record nobody reads)."""
        if recompute and region in self._plans:
            return self._plans[region], PipelineTiming()
        chosen, timing = choose()
        if torch.is_grad_enabled():
            self._plans.pop(region, None)
            self._plans[region] = chosen
            while len(self._plans) > KEPT:
                del self._plans[next(iter(self._plans))]
        return chosen, timing

    def before_bias_update(self, bias: torch.Tensor) -> None:
        """Keep the bias this forward routed with, before the forward moves it."""
        self._biases.append(bias.clone())
        del self._biases[:-KEPT]

    @contextlib.contextmanager
    def routing_bias(self, bias: torch.Tensor, recompute: bool) -> Iterator[None]:
        """Within: ``bias`` as its forward saw it, for a recompute. Recomputes run in the backward,
        in reverse order of the forwards: the latest bias not yet taken is theirs."""
        if not (recompute and self._biases):
            yield
            return
        current = bias.clone()
        bias.copy_(self._biases.pop())
        try:
            yield
        finally:
            bias.copy_(current)
