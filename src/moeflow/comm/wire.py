"""Wire formats of the token exchange: what a row of tokens is on the link (DeepEP's low-precision
dispatch and combine).

``exact`` sends rows as they are. ``bf16`` rounds rows wider than 16 bits to bfloat16 (an fp32
model's exchange sends half the bytes; a bf16 or fp16 model's is unchanged). ``fp8`` sends e4m3
values with one fp32 scale per row, the row's largest magnitude mapped to e4m3's largest (448), as
DeepEP's fp8 dispatch does: M + 4 bytes a row (:func:`moeflow.config.wire_row_bytes`). The scale
comes from the row's finite values; a non-finite value (e4m3 has no infinity) arrives as NaN, so an
overflow stays visible without costing the row's finite values. A row is
encoded just before the all-to-all and decoded just after it, into the dtype it left in, so the
expert GEMMs and the combine's weighted sum run in the compute dtype; the exchange's backward sends
the gradient rows the same way. Encoding is per row along the last dimension, so any split of the
leading dimensions (by destination rank, by chunk) is unchanged.
"""

from __future__ import annotations

import torch

from moeflow.config import BF16_WIRE, FP8_SCALE_BYTES, FP8_WIRE

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def to_wire(wire_dtype: str, x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows as they travel under ``wire_dtype``."""
    if wire_dtype == BF16_WIRE and x.element_size() > 2:
        return x.to(torch.bfloat16)
    if wire_dtype == FP8_WIRE:
        return _fp8_rows(x)
    return x


def from_wire(wire_dtype: str, sent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows that travelled under ``wire_dtype`` back in ``dtype``."""
    if wire_dtype == FP8_WIRE:
        return _from_fp8_rows(sent, dtype)
    return sent if sent.dtype == dtype else sent.to(dtype)


def _fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., M) -> (..., M + 4) bytes: each row's e4m3 values, then its fp32 scale."""
    model_dim = x.shape[-1]
    rows = x.reshape(-1, model_dim).float()
    finite = rows.isfinite()
    largest = rows.abs().where(finite, 0.0).amax(dim=1, keepdim=True)  # an inf must not take the row's scale
    smallest = torch.finfo(torch.float32).tiny  # a row of denormals keeps a normal scale
    scale = torch.where(largest > 0, (largest / E4M3_MAX).clamp_min(smallest), torch.ones_like(largest))
    # e4m3fn has no infinity (a cast saturates it to 448): a non-finite value travels as its NaN
    values = (rows / scale).where(finite, torch.nan).to(E4M3).view(torch.uint8)
    packed = torch.cat([values, scale.view(torch.uint8)], dim=1)
    return packed.view(*x.shape[:-1], model_dim + FP8_SCALE_BYTES)


def _from_fp8_rows(sent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    model_dim = sent.shape[-1] - FP8_SCALE_BYTES
    rows = sent.reshape(-1, sent.shape[-1])
    # copies with offset 0: a one-row slice counts as contiguous but starts M bytes in, which a
    # 4-byte view refuses unless M is a multiple of 4
    values = rows[:, :model_dim].clone(memory_format=torch.contiguous_format).view(E4M3).float()
    scale = rows[:, model_dim:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return (values * scale).to(dtype).view(*sent.shape[:-1], model_dim)
