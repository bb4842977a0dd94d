"""The kept-rows dispatcher: a forward with backward on a rank that holds every expert, with no capacity buffer.

Under ``expert_kernel="ragged"`` the capacity path pays for its padded (E, C, M) layout three
times over: encode scatters the kept rows into it, the ragged kernel gathers the filled slots back
out (and scatters its output in again), and decode gathers once more; the backward repeats each
step. Where one rank holds every expert nothing needs that layout. Here the kept rows go straight
into a packed (N, M) matrix ordered by expert (:func:`~moeflow.core.slot_map.make_packed_slot_map`:
the same encode and decode kernels, over a buffer with no empty slot), the experts run as grouped
GEMMs on those rows forward and backward, and decode sums each token's rows. It computes the
capacity path's function exactly: the same slots are kept (the routing's own slot assignment and
capacity), the same products are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.core.experts import FFNCompute, FFNWeights, LocalExperts
from moeflow.core.routing.router import Routing
from moeflow.core.slot_map import make_packed_slot_map
from moeflow.core.stats import PipelineTiming
from moeflow.kernels.choice import KernelChoice
from moeflow.kernels.ragged import FilledRows, RaggedSaved, packed_backward_input, packed_forward, packed_weight_grads
from moeflow.kernels.slot_gather import decode, encode
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.dispatchers.protocol import LayerCall
from moeflow.parallel.dispatchers.stats import DirectDispatcher, DirectLabels


def kept_rows_output(
    x_TM: torch.Tensor, routing: Routing, counts_E: torch.Tensor, capacity: int, experts: LocalExperts,
    kernels: KernelChoice,
) -> torch.Tensor:
    """y_t = sum over token t's kept choices of weight * expert(x_t), differentiable in x, the
    combine weights and the experts' parameters. ``routing`` has its slots assigned
    (:meth:`Routing.slotted`), ``counts_E`` are its assignments per expert on the host, ``experts``
    are all E, in x's dtype after the cast."""
    choice = routing.choice
    plan = make_packed_slot_map(choice.expert_idx_TK, routing.location_TK, counts_E, capacity)
    rows = FilledRows.counted(torch.arange(plan.num_slots), counts_E.clamp(max=capacity))
    x_NM = encode(x_TM, plan, backend=kernels.encode)
    weights = experts.weights().cast(x_TM.dtype)
    y_NM = _KeptRowsExperts.apply(x_NM, rows, experts.compute, kernels.gemm, *weights.as_tuple())
    return decode(y_NM, choice.weights_TK, plan, backend=kernels.decode)


@dataclass(frozen=True)
class KeptRowsDispatcher(DirectDispatcher):
    """One rank under the ragged kernel, with a backward: the capacity path's kept slots, packed
    (:func:`kept_rows_output`)."""

    experts: LocalExperts
    labels: DirectLabels

    def experts_output(self, call: LayerCall, routing: Routing, load: GlobalLoad, x_TM: torch.Tensor,
                       timing: PipelineTiming) -> torch.Tensor:
        capacity = load.capacity(call.capacity_factor, call.top_k)
        slotted = routing.slotted(load.counts_WE.shape[1])
        return kept_rows_output(x_TM, slotted, load.counts_WE[0], capacity, self.experts, call.kernels)



class _KeptRowsExperts(torch.autograd.Function):
    """The experts over packed rows ordered by expert, as one autograd node (the ragged kernel's
    forward and backward without the gathers out of and scatters into the padded layout)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x_NM: torch.Tensor, rows: FilledRows, base: FFNCompute, backend: str, w1: torch.Tensor,
        b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, w3: torch.Tensor | None,
        b3: torch.Tensor | None,
    ) -> torch.Tensor:
        y_NM, saved = packed_forward(base, x_NM, rows, FFNWeights(w1, b1, w2, b2, w3, b3), backend)
        ctx.save_for_backward(w1, b1, w2, b2, w3, b3, saved.x_NM, saved.h_NH, saved.a_NH, saved.up_NH)
        ctx.rows, ctx.base, ctx.backend = rows, base, backend
        return y_NM

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_y_NM: torch.Tensor):  # type: ignore[override]
        w1, b1, w2, b2, w3, b3, x_NM, h_NH, a_NH, up_NH = ctx.saved_tensors
        weights = FFNWeights(w1, b1, w2, b2, w3, b3)
        saved = RaggedSaved(ctx.rows, None, x_NM, h_NH, a_NH, up_NH)
        grad_x_NM, inputs = packed_backward_input(ctx.base.activation, saved, grad_y_NM.contiguous(), weights,
                                                  ctx.backend)
        return grad_x_NM, None, None, None, *packed_weight_grads(ctx.base, inputs, ctx.rows, weights, ctx.backend)
