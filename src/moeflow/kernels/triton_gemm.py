"""Ragged grouped GEMM in Triton: every local expert multiplies exactly its own rows.

The rows of a packed (N, K) matrix are ordered by expert (``counts_L[l]`` rows of expert l). The
forward and the input gradient are one launch over row tiles (a tile never straddles two experts,
so an expert with no rows has no tile and its weights are never read); the weight gradient is one
launch over (expert, K block, J block) tiles that each reduce over that expert's rows (an expert
with no rows gets zeros). Accumulation is fp32; fp32 inputs multiply in IEEE fp32 (torch's
default for fp32 matmuls), bf16/fp16 inputs on the tensor cores.

Triton's CPU interpreter multiplies bf16 tiles as their raw bits (3.9: ``tl.dot`` of bf16 gives
nonsense), so there the tiles are widened to fp32 first: the same numerics as the tensor cores,
whose bf16 products are exact in fp32 and accumulate in fp32.

The block sizes are fixed, not autotuned: autotuning runs every candidate under the interpreter,
and no GPU has been at hand to tune them on (``moeflow bench kernels`` reports the rate they get).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

ROWS_BLOCK = 64
COLUMNS_BLOCK = 64
INNER_BLOCK = 32


@triton.jit
def _grouped_mm_kernel(a, b, out, tile_expert, tile_row, expert_end, K, J, a_stride, b_stride_l, b_stride_k,
                       b_stride_j, out_stride, PRECISION: tl.constexpr, WIDEN: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile).to(tl.int64)
    end = tl.load(expert_end + expert)
    rows = tl.load(tile_row + tile) + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for start in range(0, K, BK):
        inner = start + tl.arange(0, BK)
        left = tl.load(a + rows[:, None] * a_stride + inner[None, :],
                       mask=(rows[:, None] < end) & (inner[None, :] < K), other=0.0)
        right = tl.load(b + expert * b_stride_l + inner[:, None] * b_stride_k + cols[None, :] * b_stride_j,
                        mask=(inner[:, None] < K) & (cols[None, :] < J), other=0.0)
        if WIDEN:
            left, right = left.to(tl.float32), right.to(tl.float32)
        total = tl.dot(left, right, total, input_precision=PRECISION)
    tl.store(out + rows[:, None] * out_stride + cols[None, :], total.to(out.dtype.element_ty),
             mask=(rows[:, None] < end) & (cols[None, :] < J))


@triton.jit
def _grouped_weight_grad_kernel(a, g, out, expert_bounds, K, J, a_stride, g_stride, PRECISION: tl.constexpr,
                                WIDEN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr):
    expert = tl.program_id(0).to(tl.int64)
    inner = tl.program_id(1) * BK + tl.arange(0, BK)
    cols = tl.program_id(2) * BJ + tl.arange(0, BJ)
    begin = tl.load(expert_bounds + expert)
    end = tl.load(expert_bounds + expert + 1)
    total = tl.zeros((BK, BJ), dtype=tl.float32)
    for start in range(begin, end, BR):
        rows = start + tl.arange(0, BR)
        left = tl.load(a + rows[None, :] * a_stride + inner[:, None],
                       mask=(rows[None, :] < end) & (inner[:, None] < K), other=0.0)  # a^T: (BK, BR)
        right = tl.load(g + rows[:, None] * g_stride + cols[None, :],
                        mask=(rows[:, None] < end) & (cols[None, :] < J), other=0.0)
        if WIDEN:
            left, right = left.to(tl.float32), right.to(tl.float32)
        total = tl.dot(left, right, total, input_precision=PRECISION)
    tl.store(out + expert * K * J + inner[:, None] * J + cols[None, :], total.to(out.dtype.element_ty),
             mask=(inner[:, None] < K) & (cols[None, :] < J))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


def _widen(kernel: object, dtype: torch.dtype) -> bool:
    return isinstance(kernel, InterpretedFunction) and dtype == torch.bfloat16


def _host_bounds(counts_L: torch.Tensor) -> torch.Tensor:
    """Where each expert's rows begin and end, on the host: the grid's size is read from the counts,
    which the layer keeps on the host (on the device, reading it would stall the host per GEMM)."""
    counts_L = counts_L.to("cpu", torch.int64)
    return torch.cat([counts_L.new_zeros(1), torch.cumsum(counts_L, 0)])


def _row_tiles(counts_L: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row tile's expert and first row, and each expert's end row: built on the host, sent in
    one copy that does not wait for the device (a pageable host-to-device copy is staged at once)."""
    bounds = _host_bounds(counts_L)
    tiles_L = -(-bounds.diff() // ROWS_BLOCK)
    tiles = int(tiles_L.sum())
    tile_expert = torch.repeat_interleave(torch.arange(tiles_L.numel()), tiles_L, output_size=tiles)
    first_tile_L = torch.cumsum(tiles_L, 0) - tiles_L
    tile_row = bounds[tile_expert] + (torch.arange(tiles) - first_tile_L[tile_expert]) * ROWS_BLOCK
    tables = torch.cat([tile_expert, tile_row, bounds[1:]]).to(device, non_blocking=True)
    return tables[:tiles], tables[tiles : 2 * tiles], tables[2 * tiles :]


def grouped_mm(a_NK: torch.Tensor, b_LKJ: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """(N, J): rows of expert l times ``b_LKJ[l]`` (any strides: a transposed view is not copied)."""
    rows, inner = a_NK.shape
    cols = b_LKJ.shape[2]
    out = a_NK.new_empty((rows, cols))
    if rows == 0 or cols == 0:
        return out
    if inner == 0:
        return out.zero_()
    tile_expert, tile_row, expert_end = _row_tiles(counts_L, a_NK.device)
    a_NK = a_NK.contiguous()
    _grouped_mm_kernel[(tile_expert.numel(), triton.cdiv(cols, COLUMNS_BLOCK))](
        a_NK, b_LKJ, out, tile_expert, tile_row, expert_end, inner, cols, a_NK.stride(0), *b_LKJ.stride(),
        out.stride(0), PRECISION=_precision(a_NK.dtype), WIDEN=_widen(_grouped_mm_kernel, a_NK.dtype),
        BM=ROWS_BLOCK, BN=COLUMNS_BLOCK, BK=INNER_BLOCK,
    )
    return out


def grouped_weight_grad(a_NK: torch.Tensor, g_NJ: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """(L, K, J): for each expert l, its rows of a transposed times its rows of g (zeros if none)."""
    experts, inner, cols = counts_L.numel(), a_NK.shape[1], g_NJ.shape[1]
    out = a_NK.new_empty((experts, inner, cols))
    if out.numel() == 0:
        return out
    a_NK, g_NJ = a_NK.contiguous(), g_NJ.contiguous()
    bounds = _host_bounds(counts_L).to(a_NK.device, non_blocking=True)
    _grouped_weight_grad_kernel[(experts, triton.cdiv(inner, COLUMNS_BLOCK), triton.cdiv(cols, COLUMNS_BLOCK))](
        a_NK, g_NJ, out, bounds, inner, cols, a_NK.stride(0), g_NJ.stride(0), PRECISION=_precision(a_NK.dtype),
        WIDEN=_widen(_grouped_weight_grad_kernel, a_NK.dtype), BR=INNER_BLOCK, BK=COLUMNS_BLOCK, BJ=COLUMNS_BLOCK,
    )
    return out
