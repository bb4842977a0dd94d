"""Fused encode/decode in Triton (Tutel 4.2's sparse kernels): the same functions as
:mod:`moeflow.kernels.slot_gather`, with no (S, M) intermediate anywhere.

Three kernels cover both directions and their gradients:

- ``gather_rows``: out[s] = scale[s] * src[index[s]], zero where index[s] < 0 (encode; the
  gradient of decode's buffer, scaled by each slot's gate weight);
- ``bag_sum``: out[t] = sum over token t's kept assignments n of weight[n] * rows[slot[n]]
  (decode; the gradient of encode, unweighted), accumulated in fp32;
- ``pair_dots``: out[n] = a[a_index[n]] . b[b_index[n]] (the gradient of the gate weights),
  without materializing the products.

Every program owns one row and a block of columns, so a token's k copies are summed in one
program and no atomics are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.core.slot_map import SlotMap

COLUMN_BLOCK = 256  # columns per program: a row of M <= 256 is one program


@triton.jit
def _gather_rows_kernel(src, index, scale, out, M, src_stride, out_stride,
                        HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    source = tl.load(index + row)
    inside = cols < M
    filled = inside & ((cols * 0 + source) >= 0)  # an empty slot reads nothing and stores zeros
    values = tl.load(src + tl.maximum(source, 0) * src_stride + cols, mask=filled, other=0.0)
    if HAS_SCALE:  # in fp32, rounded once (and Triton's interpreter multiplies bf16 as raw bits)
        values = values.to(tl.float32) * tl.load(scale + row).to(tl.float32)
    tl.store(out + row * out_stride + cols, values.to(out.dtype.element_ty), mask=inside)


@triton.jit
def _bag_sum_kernel(rows, slots, bounds, weight, out, M, rows_stride, out_stride,
                    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < M
    begin = tl.load(bounds + token)
    end = tl.load(bounds + token + 1)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for n in range(begin, end):
        slot = tl.load(slots + n)
        values = tl.load(rows + slot * rows_stride + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            values = values * tl.load(weight + n).to(tl.float32)
        total += values
    tl.store(out + token * out_stride + cols, total.to(out.dtype.element_ty), mask=inside)


@triton.jit
def _pair_dots_kernel(a, a_index, b, b_index, out, M, a_stride, b_stride, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    a_row = tl.load(a_index + pair)
    b_row = tl.load(b_index + pair)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, M, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < M
        left = tl.load(a + a_row * a_stride + cols, mask=inside, other=0.0).to(tl.float32)
        right = tl.load(b + b_row * b_stride + cols, mask=inside, other=0.0).to(tl.float32)
        total += left * right
    tl.store(out + pair, tl.sum(total, axis=0).to(out.dtype.element_ty))


def _block(columns: int) -> int:
    return min(COLUMN_BLOCK, triton.next_power_of_2(max(columns, 16)))


def gather_rows(src_RM: torch.Tensor, index_S: torch.Tensor, scale_S: torch.Tensor | None = None) -> torch.Tensor:
    """(S, M): row index[s] of src times scale[s]; zero rows where index[s] < 0."""
    rows, columns = index_S.shape[0], src_RM.shape[1]
    out = src_RM.new_empty((rows, columns))
    if rows == 0 or columns == 0:
        return out.zero_()
    block = _block(columns)
    _gather_rows_kernel[(rows, triton.cdiv(columns, block))](
        src_RM, index_S, scale_S if scale_S is not None else index_S, out, columns, src_RM.stride(0),
        out.stride(0), HAS_SCALE=scale_S is not None, BLOCK=block,
    )
    return out


def bag_sum(rows_SM: torch.Tensor, slots: SlotMap, weight_N: torch.Tensor | None = None) -> torch.Tensor:
    """(T, M): y_t = sum over token t's kept assignments n of (weight_n *) rows[slot_n]."""
    columns = rows_SM.shape[1]
    out = rows_SM.new_empty((slots.num_tokens, columns))
    if slots.num_tokens == 0 or columns == 0:
        return out.zero_()
    # no host tensor: no copy
    bounds = torch.nn.functional.pad(slots.offsets_T, (0, 1), value=slots.slot_idx_N.shape[0])
    block = _block(columns)
    _bag_sum_kernel[(slots.num_tokens, triton.cdiv(columns, block))](
        rows_SM, slots.slot_idx_N, bounds, weight_N if weight_N is not None else rows_SM, out, columns,
        rows_SM.stride(0), out.stride(0), HAS_WEIGHT=weight_N is not None, BLOCK=block,
    )
    return out


def pair_dots(a_XM: torch.Tensor, a_index_N: torch.Tensor, b_YM: torch.Tensor, b_index_N: torch.Tensor) -> torch.Tensor:
    """(N,): a[a_index[n]] . b[b_index[n]], accumulated in fp32."""
    pairs = a_index_N.shape[0]
    out = a_XM.new_empty(pairs)
    if pairs == 0:
        return out
    _pair_dots_kernel[(pairs,)](
        a_XM, a_index_N, b_YM, b_index_N, out, a_XM.shape[1], a_XM.stride(0), b_YM.stride(0),
        BLOCK=_block(a_XM.shape[1]),
    )
    return out


def slot_sources(slots: SlotMap) -> torch.Tensor:
    """The token of every slot, -1 for the empty ones (which the kernels fill with zeros)."""
    return slots.slot_token_S.clone().index_fill_(0, slots.empty_slots, -1)


class TritonEncode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x_TM: torch.Tensor, slots: SlotMap) -> torch.Tensor:
        ctx.slots = slots
        return gather_rows(x_TM, slot_sources(slots))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_SM: torch.Tensor):  # type: ignore[override]
        return bag_sum(grad_SM.contiguous(), ctx.slots), None


class TritonDecode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, buffer_SM: torch.Tensor, weight_N: torch.Tensor, slots: SlotMap) -> torch.Tensor:
        ctx.slots = slots
        ctx.save_for_backward(buffer_SM, weight_N)
        return bag_sum(buffer_SM, slots, weight_N)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_TM: torch.Tensor):  # type: ignore[override]
        buffer_SM, weight_N = ctx.saved_tensors
        slots: SlotMap = ctx.slots
        grad_TM = grad_TM.contiguous()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = pair_dots(grad_TM, slots.token_idx_N, buffer_SM, slots.slot_idx_N)
        return gather_rows(grad_TM, slot_sources(slots), slots.per_slot(weight_N)), grad_weight, None
