"""FasterMoE's smart fine-grained schedule (§4.2) of the expert-parallel region.

The exchange is split into the n steps of the grouped pairwise all-to-all (the groups are the
nodes): in step j a rank of group i sends its tokens for the experts of group i - j and receives
the tokens of group i + j (S), computes its local experts on them (C), and sends the outputs back
while receiving its own tokens' outputs from group i - j (R). The communication worker runs
S_0 .. S_{n-1} then R_0 .. R_{n-1} in that order while the calling thread computes C_0 .. C_{n-1}:
C_j overlaps S_{j+1} and R_{j-1}. S_0 stays inside the node (nothing travels with one rank per
node) and R_{n-1} exchanges with the neighbouring group: the two cheapest operations sit at the
ends, which is the paper's schedule. The backward runs the same steps on the output gradient with
the experts' backward (an equal-split exchange is its own adjoint); weight gradients are one
deferred GEMM over all steps.

How it relates to the capacity-chunk pipeline (:mod:`moeflow.parallel.chunk_pipeline`): both overlap the same
dispatch -> experts -> combine region, along different axes. The capacity pipeline cuts every
expert's slots into d chunks and runs a whole all-to-all per chunk, so its first computation waits
for one chunk's full exchange; the smart schedule cuts by source node, so its first computation
(the node's own tokens) waits for no inter-node transfer, and its degree is the number of nodes.
The planner ranks it beside the capacity pipeline's (degree, algorithm) plans as the plan
``Plan("smart", 1, "pairwise")``; ``pipeline="smart"`` forces it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.algorithms import pairwise_peers, pairwise_step
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.config import EXACT_WIRE, wire_row_bytes
from moeflow.core.experts import ExpertCompute, FFNSaved, FFNWeightGradInputs, FFNWeights
from moeflow.core.stats import PipelineTiming
from moeflow.core.workspace import Workspace
from moeflow.kernels.saved_activations import save_with_records, saved_with_records
from moeflow.parallel.chunk_pipeline import overlap
from moeflow.perf.schedule_models import SMART


@dataclass(frozen=True)
class SmartSteps:
    """The pairwise steps of one rank: step j receives tokens from the ranks of group i + j."""

    groups: ParallelGroups
    local_experts: int
    wire_dtype: str = EXACT_WIRE  # how the steps' rows travel (moeflow.comm.wire)

    @property
    def topology(self) -> Topology:
        return self.groups.topology

    @property
    def count(self) -> int:
        return self.topology.num_nodes

    def sources(self, step: int) -> list[int]:
        return pairwise_peers(self.topology, self.groups.rank, step)[1]


def check_smart_pipeline(pipeline: int | str, groups: ParallelGroups) -> None:
    """``pipeline="smart"`` needs the expert group's node layout: its pairwise steps go node by
    node (that it runs on the expert-parallel schedule is the registry's rule)."""
    if pipeline == SMART and groups.size > 1 and not groups.knows_nodes:
        raise ValueError(
            "pipeline='smart' runs FasterMoE's pairwise steps node by node, and this layer's custom group has no "
            f"node layout: {groups.node_layout_problem}; or use pipeline='auto'"
        )


def run_steps(
    buffer_ECM: torch.Tensor, steps: SmartSteps, compute: Callable[[int, torch.Tensor], torch.Tensor],
    after_compute: Callable[[], None] | None = None,
) -> torch.Tensor:
    """out[experts of rank d] = the outputs rank d computed for this rank's tokens, with
    ``compute(j, x_LXM)`` run on the (L, sources * C, M) tokens that step j received."""
    world, local = steps.groups.size, steps.local_experts
    _, capacity, model_dim = buffer_ECM.shape
    rows = local * capacity
    matrix = [[rows] * world for _ in range(world)]
    by_dest = list(buffer_ECM.view(world, rows, model_dim).unbind(0))
    out_ECM = torch.empty_like(buffer_ECM)
    out_by_dest = out_ECM.view(world, rows, model_dim)

    ledger, group = steps.groups.ledger, steps.groups.expert
    step_bytes = wire_row_bytes(steps.wire_dtype, model_dim, buffer_ECM.element_size()) * buffer_ECM.numel() \
        // model_dim // steps.count
    device = buffer_ECM.device  # Lina's all-to-all times: CUDA events on CUDA tensors

    def send(step: int) -> torch.Tensor:
        with steps.groups.traffic.running(device), ledger.tracked("pairwise all-to-all step", group, step_bytes):
            received = pairwise_step(by_dest, steps.groups, matrix, step, steps.wire_dtype)
        parts = [received[source].view(local, capacity, model_dim) for source in steps.sources(step)]
        return torch.cat(parts, dim=1)  # (L, sources * C, M), source-major like the all-to-all layout

    def receive(step: int, y_LXM: torch.Tensor) -> None:
        sources = steps.sources(step)
        by_source = y_LXM.view(local, len(sources), capacity, model_dim).transpose(0, 1)
        back = [by_dest[0]] * world  # only the entries of this step's sources are sent
        for index, source in enumerate(sources):
            back[source] = by_source[index].reshape(rows, model_dim)
        with steps.groups.traffic.running(device), ledger.tracked("pairwise all-to-all step", group, step_bytes):
            returned = pairwise_step(back, steps.groups, matrix, (steps.count - step) % steps.count, steps.wire_dtype)
        for dest, rows_back in returned.items():
            out_by_dest[dest].copy_(rows_back)

    sends = [functools.partial(send, step) for step in range(steps.count)]
    overlap(steps.groups, buffer_ECM.device, sends, compute, receive, after_compute)
    return out_ECM


class _SmartExperts(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, buffer_ECM: torch.Tensor, steps: SmartSteps, computes: list[ExpertCompute],
        timing: PipelineTiming, workspace: Workspace | None, for_backward: bool, *weight_tensors: torch.Tensor | None,
    ) -> torch.Tensor:
        start = timing.now()
        weights = FFNWeights(*weight_tensors)
        saved: list[FFNSaved | None] = [None] * steps.count

        def expert_forward(step: int, x_LXM: torch.Tensor) -> torch.Tensor:
            begin = time.perf_counter()
            y_LXM, saved[step] = computes[step].forward(x_LXM, weights, workspace)
            timing.expert_forward_s += time.perf_counter() - begin
            return y_LXM

        out_ECM = run_steps(buffer_ECM.contiguous(), steps, expert_forward)
        save_with_records(ctx, weight_tensors, saved if for_backward else [])
        ctx.steps, ctx.computes, ctx.timing, ctx.workspace = steps, computes, timing, workspace
        timing.forward_s = timing.now() - start
        return out_ECM

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out_ECM: torch.Tensor):  # type: ignore[override]
        start = ctx.timing.now()
        weight_tensors, saved = saved_with_records(ctx)
        weights = FFNWeights(*weight_tensors)
        computes: list[ExpertCompute] = ctx.computes
        pending: list[FFNWeightGradInputs] = []
        totals: list[torch.Tensor | None] = [None] * len(weight_tensors)

        def expert_backward(step: int, grad_y_LXM: torch.Tensor) -> torch.Tensor:
            begin = time.perf_counter()
            grad_x_LXM, inputs = computes[step].backward_input(saved[step], grad_y_LXM, weights, ctx.workspace)
            pending.append(inputs)
            ctx.timing.expert_backward_s += time.perf_counter() - begin
            return grad_x_LXM

        def weight_gradients() -> None:  # one GEMM per weight over every step's rows, overlapping the last R
            begin = time.perf_counter()
            totals[:] = computes[0].weight_grads(type(pending[0]).concat(pending, ctx.workspace), weights,
                                                 ctx.workspace)
            pending.clear()
            ctx.timing.expert_backward_s += time.perf_counter() - begin

        grad_buffer_ECM = run_steps(grad_out_ECM.contiguous(), ctx.steps, expert_backward, weight_gradients)
        ctx.timing.backward_s = (ctx.timing.backward_s or 0.0) + ctx.timing.now() - start
        return grad_buffer_ECM, None, None, None, None, None, *totals


def smart_experts(
    buffer_ECM: torch.Tensor, compute: ExpertCompute, weights: FFNWeights, groups: ParallelGroups,
    timing: PipelineTiming | None = None, workspace: Workspace | None = None, wire_dtype: str = EXACT_WIRE,
) -> torch.Tensor:
    """Dispatch -> experts -> combine of an (E, C, M) buffer in FasterMoE's pairwise steps, the rows
    travelling as ``wire_dtype`` says; returns the combined buffer, differentiable in the buffer and
    the expert weights."""
    steps = SmartSteps(groups, weights.w1.shape[0], wire_dtype)
    computes = [compute.of_sources(steps.sources(step)) for step in range(steps.count)]
    tensors = weights.as_tuple()
    for_backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (buffer_ECM, *tensors)
    )
    return _SmartExperts.apply(
        buffer_ECM, steps, computes, timing if timing is not None else PipelineTiming(), workspace, for_backward,
        *tensors,
    )
