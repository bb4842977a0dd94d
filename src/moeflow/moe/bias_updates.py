"""When the loss-free balancing bias (DeepSeek-V3) moves: after each training forward, or once
after several forwards that make one step (a pipeline's micro-batches), from the load of them all."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.comm.collectives import all_reduce
from moeflow.core.routing.router import update_expert_bias


class BiasUpdates:
    """A layer's bias updates: made at once, or held until :meth:`release`."""

    def __init__(self) -> None:
        self._held: list[torch.Tensor] | None = None  # forwards' loads while held

    def hold(self) -> None:
        self._held = []

    def after_forward(self, gate: nn.Module, load_E: torch.Tensor, rate: float) -> None:
        """A training forward's load: moves the bias now, or is kept while held."""
        if self._held is None:
            update_expert_bias(gate, load_E, rate)
        else:
            self._held.append(load_E)

    def release(self, gate: nn.Module, rate: float, replicas: dist.ProcessGroup | None) -> None:
        """Move the bias once from the held loads summed, and over ``replicas`` (every rank of
        that group calls it); stop holding."""
        loads, self._held = self._held, None
        if loads:
            load_E = torch.stack(loads).sum(0)
            if replicas is not None:
                all_reduce(load_E, replicas)
            update_expert_bias(gate, load_E, rate)
