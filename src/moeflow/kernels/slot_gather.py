"""Fast encode/decode (Tutel 4.2, Appendix B): sparse scatter into expert buffers and back.

Shapes: T tokens, M model dim, E experts, C capacity, K top-k, N kept (token, expert) assignments,
S = E*C slots. Both directions are gathers (``index_select``, fused ``embedding_bag``) costing
O(N*M) time and memory; no dense (T, E, C) dispatch mask is ever built. A :class:`SlotMap`
is immutable and carries everything decode needs, so several plans (pipeline chunks) can be in
flight at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.core.slot_map import SlotMap, make_packed_slot_map, make_slot_map, make_static_slot_map
from moeflow.core.workspace import Workspace, buffer

__all__ = ["SlotMap", "decode", "encode", "make_packed_slot_map", "make_slot_map", "make_static_slot_map"]


def _bag_sum(
    rows_SM: torch.Tensor, slots: SlotMap, weight_N: torch.Tensor | None = None
) -> torch.Tensor:
    """y_t = sum over the kept assignments n of token t of (weight_n *) rows[slot_n]: one pass."""
    if slots.num_tokens == 0 or rows_SM.shape[0] == 0:
        return rows_SM.new_zeros((slots.num_tokens, rows_SM.shape[1]))
    return F.embedding_bag(
        slots.slot_idx_N, rows_SM, slots.offsets_T, mode="sum", per_sample_weights=weight_N
    )


def _rows_per_slot(rows_TM: torch.Tensor, slots: SlotMap, workspace: Workspace | None) -> torch.Tensor:
    """(S, M): the row of the token each slot holds (garbage for empty slots, callers mask). The
    result flows on through autograd; a workspace reuses it once nothing references it."""
    shape = (slots.num_slots, rows_TM.shape[1])
    if slots.num_tokens == 0:
        return rows_TM.new_zeros(shape)
    return torch.index_select(rows_TM, 0, slots.slot_token_S, out=buffer(workspace, shape, rows_TM))


ROW_DOT_BLOCK = 256  # rows per block: a (256, M) product stays in cache


def _row_dots(a_SM: torch.Tensor, b_SM: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products, a block of rows at a time: ``vecdot`` materializes the whole (S, M)
    product, a fresh multi-MB buffer that cost 4-5x the arithmetic in page faults and cache misses.
    On a GPU, where that loop is hundreds of launches, one batched product of (1, M) by (M, 1)."""
    if a_SM.device.type != "cpu":
        return torch.bmm(a_SM.unsqueeze(1), b_SM.unsqueeze(2)).view(-1)
    num_rows = a_SM.shape[0]
    out_S = a_SM.new_empty(num_rows)
    block = a_SM.new_empty((min(ROW_DOT_BLOCK, num_rows), a_SM.shape[1]))
    for start in range(0, num_rows, ROW_DOT_BLOCK):
        stop = min(start + ROW_DOT_BLOCK, num_rows)
        product = torch.mul(a_SM[start:stop], b_SM[start:stop], out=block[: stop - start])
        torch.sum(product, dim=1, out=out_S[start:stop])
    return out_S


class _FastEncode(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x_TM: torch.Tensor, slots: SlotMap, workspace: Workspace | None
    ) -> torch.Tensor:
        ctx.slots = slots
        buffer_SM = _rows_per_slot(x_TM, slots, workspace)
        if slots.occupied_S is not None:  # a static plan: the empty slots by mask, not by a list sized by their count
            return buffer_SM.mul_(slots.occupied_S.unsqueeze(1))
        return buffer_SM.index_fill_(0, slots.empty_slots, 0)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_SM: torch.Tensor):  # type: ignore[override]
        return _bag_sum(grad_SM.contiguous(), ctx.slots), None, None


def _slot_of_choice(slots: SlotMap) -> torch.Tensor:
    """(T, K): the slot of every kept choice, 0 for a dropped one (whose weight is 0 where it is read)."""
    slot_TK = torch.zeros(slots.choice_mask_TK.shape, dtype=torch.int64, device=slots.slot_idx_N.device)
    slot_TK.view(-1).index_copy_(0, slots.choice_idx_N, slots.slot_idx_N)
    return slot_TK


def _gathered_bag_sum(rows_SM: torch.Tensor, slots: SlotMap, weight_TK: torch.Tensor) -> torch.Tensor:
    """y_t = sum over j of weight_tj * rows[slot_tj], as one gather of every token's K rows and one
    batched (1 x K) by (K x M) product: on a GPU ``embedding_bag`` reached 0.10 of the copy
    bandwidth at M = 1024 (an H200, 2026-11-26), a gather 0.47. A dropped choice reads row 0 with
    weight 0."""
    num_tokens, top_k = weight_TK.shape
    if num_tokens == 0 or rows_SM.shape[0] == 0:
        return rows_SM.new_zeros((num_tokens, rows_SM.shape[1]))
    gathered_TKM = rows_SM.index_select(0, _slot_of_choice(slots).flatten()).view(num_tokens, top_k, -1)
    return torch.bmm(weight_TK.to(rows_SM.dtype).unsqueeze(1), gathered_TKM).squeeze(1)


class _GatherDecode(torch.autograd.Function):
    """Decode as a gathered bag (``weight_TK``: the combine weights, 0 where a choice was dropped)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, buffer_SM: torch.Tensor, weight_TK: torch.Tensor, slots: SlotMap,
        workspace: Workspace | None,
    ) -> torch.Tensor:
        ctx.slots, ctx.workspace = slots, workspace
        ctx.save_for_backward(buffer_SM, weight_TK)
        return _gathered_bag_sum(buffer_SM, slots, weight_TK)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_TM: torch.Tensor):  # type: ignore[override]
        buffer_SM, weight_TK = ctx.saved_tensors
        slots: SlotMap = ctx.slots
        grad_TM = grad_TM.contiguous()
        slot_TK = _slot_of_choice(slots)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # <grad y_t, rows[slot_tj]> for every choice (dropped ones are masked outside)
            gathered_TKM = buffer_SM.index_select(0, slot_TK.flatten()).view(*slot_TK.shape, buffer_SM.shape[1])
            grad_weight = torch.bmm(gathered_TKM, grad_TM.unsqueeze(2)).squeeze(2).to(weight_TK.dtype)
        weight_S = weight_TK.new_zeros(slots.num_slots).index_put_((slot_TK.flatten(),), weight_TK.flatten(),
                                                                  accumulate=True)  # dropped: 0 into slot 0
        grad_buffer = _rows_per_slot(grad_TM, slots, ctx.workspace).mul_(weight_S.to(grad_TM.dtype).unsqueeze(1))
        return grad_buffer, grad_weight, None, None


class _GatherEncode(_FastEncode):
    """Encode as the torch backend does; its backward sums each token's slots as a gathered bag."""

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_SM: torch.Tensor):  # type: ignore[override]
        slots: SlotMap = ctx.slots
        return _gathered_bag_sum(grad_SM.contiguous(), slots, slots.choice_mask_TK), None, None


class _FastDecode(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, buffer_SM: torch.Tensor, weight_N: torch.Tensor, slots: SlotMap,
        workspace: Workspace | None,
    ) -> torch.Tensor:
        ctx.slots, ctx.workspace = slots, workspace
        ctx.save_for_backward(buffer_SM, weight_N)
        return _bag_sum(buffer_SM, slots, weight_N)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_TM: torch.Tensor):  # type: ignore[override]
        buffer_SM, weight_N = ctx.saved_tensors
        slots: SlotMap = ctx.slots
        grad_per_slot_SM = _rows_per_slot(grad_TM.contiguous(), slots, ctx.workspace)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight_S = _row_dots(grad_per_slot_SM, buffer_SM)
            grad_weight = grad_weight_S.index_select(0, slots.slot_idx_N)
        grad_buffer = grad_per_slot_SM.mul_(slots.per_slot(weight_N).unsqueeze(1))  # empty slots: weight 0
        return grad_buffer, grad_weight, None, None


def encode(
    x_TM: torch.Tensor, slots: SlotMap, workspace: Workspace | None = None, backend: str = "torch"
) -> torch.Tensor:
    """Scatter kept token copies into the expert buffer (E, C, M); empty slots are zero. A packed
    plan (:func:`~moeflow.core.slot_map.make_packed_slot_map`) gives the (N, M) kept rows instead.
    ``backend="triton"`` runs the fused Triton kernels (:mod:`moeflow.kernels.triton_dispatch`)."""
    if backend == "triton":
        from moeflow.kernels.triton_dispatch import TritonEncode

        buffer_SM = TritonEncode.apply(x_TM.contiguous(), slots)
    elif backend == "gather":
        buffer_SM = _GatherEncode.apply(x_TM.contiguous(), slots, workspace)
    else:
        buffer_SM = _FastEncode.apply(x_TM.contiguous(), slots, workspace)
    if slots.packed_slots is not None:
        return buffer_SM
    return buffer_SM.view(slots.num_experts, slots.capacity, x_TM.shape[1])


def decode(
    buffer_ECM: torch.Tensor, weights_TK: torch.Tensor, slots: SlotMap, workspace: Workspace | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Weighted gather back to tokens: y_t = sum over kept choices of w_tj * buffer[slot_tj]."""
    buffer_SM = buffer_ECM.reshape(slots.num_slots, buffer_ECM.shape[-1]).contiguous()
    if backend == "gather":
        kept_weights_TK = weights_TK * slots.choice_mask_TK  # a dropped choice's weight (and gradient) is 0
        return _GatherDecode.apply(buffer_SM, kept_weights_TK.to(buffer_SM.dtype), slots, workspace)
    # no boolean index: no sync
    weight_N = weights_TK.flatten().index_select(0, slots.choice_idx_N).to(buffer_ECM.dtype)
    if backend == "triton":
        from moeflow.kernels.triton_dispatch import TritonDecode

        return TritonDecode.apply(buffer_SM, weight_N, slots)
    return _FastDecode.apply(buffer_SM, weight_N, slots, workspace)
