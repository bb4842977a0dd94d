"""The static-shape dispatcher: a step on one rank whose shapes never depend on the routing.

Every other path reads the routing counts on the host (capacity, the kept rows, the plan). On a
GPU that read drains the queue, and the device then waits while the host queues the rest of the
step: on an H200 a third of the 64-expert layer's step (docs/benchmarks/2026-11-27-gpu-host.md).
Here capacity comes from the factor alone (Tutel's Eq. 1 with f > 0), every one of the T*k choices
has a place in a plan of fixed size (:func:`~moeflow.core.slot_map.make_static_slot_map`: a
dropped choice reads slot 0 with weight 0), the experts run padded over the (E, C, M) buffer, and
the statistics read the counts only when asked for. Nothing waits for the device, so the layer's
forward and backward can be captured in a CUDA graph (:func:`moeflow.moe.cuda_graph.graphed_layer`).
It computes the capacity path's function: the same slots are kept (the routing's own order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from moeflow.core.capacity import expert_capacity
from moeflow.core.experts import ExpertFFN
from moeflow.core.routing.router import Routing
from moeflow.core.slot_map import make_static_slot_map
from moeflow.core.stats import PipelineTiming
from moeflow.kernels.slot_gather import decode, encode
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.dispatchers.protocol import LayerCall, Stats
from moeflow.parallel.dispatchers.stats import DirectDispatcher, DirectLabels

STATIC = "static"
"""The step-shapes setting, and the plan source the statistics name, of a static step."""
GATHER = "gather"
"""The encode and decode kernels a static plan runs: the ones that weight each choice by its mask."""


def static_output(x_TM: torch.Tensor, routing: Routing, experts: ExpertFFN, capacity_factor: float,
                  top_k: int) -> torch.Tensor:
    """y_t = sum over token t's kept choices of weight * expert(x_t), with capacity
    ceil(k f T / E) and no value read on the host; differentiable in x, the combine weights and
    the experts' parameters."""
    num_experts = experts.num_experts
    capacity = expert_capacity(capacity_factor, top_k, x_TM.shape[0], num_experts, needed=0)
    slotted = routing.slotted(num_experts)
    slots = make_static_slot_map(slotted.choice.expert_idx_TK, slotted.location_TK, num_experts, capacity)
    rows_ECM = encode(x_TM, slots, backend=GATHER)
    return decode(experts(rows_ECM), routing.choice.weights_TK, slots, backend=GATHER)


@dataclass(frozen=True)
class StaticDispatcher(DirectDispatcher):
    """One rank, shapes from the call alone (:func:`static_output`); statistics on first read."""

    experts: ExpertFFN
    labels: DirectLabels
    expert_kernel: ClassVar[str] = "bmm"
    source: ClassVar[str] = STATIC

    def experts_output(self, call: LayerCall, routing: Routing, load: GlobalLoad, x_TM: torch.Tensor,
                       timing: PipelineTiming) -> torch.Tensor:
        return static_output(x_TM, routing, self.experts, call.capacity_factor, call.top_k)

    def stats(self, call: LayerCall, load: GlobalLoad, timing: PipelineTiming) -> Stats:
        """The direct statistics, naming the kernels a static plan runs."""
        ran = dataclasses.replace(call, kernels=dataclasses.replace(call.kernels, encode=GATHER, decode=GATHER))
        return super().stats(ran, load, timing)
