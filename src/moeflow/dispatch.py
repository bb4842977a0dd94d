"""Fast encode/decode (Tutel 4.2, Appendix B): sparse scatter into expert buffers and back.

Shapes: T tokens, M model dim, E experts, C capacity, K top-k, N kept (token, expert) assignments,
S = E*C slots. Both directions are index operations costing O(N*M) time and memory; no dense
(T, E, C) dispatch mask is ever built. A :class:`DispatchPlan` is immutable and carries everything
decode needs, so several plans (pipeline chunks) can be in flight at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx


@dataclass(frozen=True)
class DispatchPlan:
    """Where each kept assignment comes from (token) and goes to (slot = expert * C + location)."""

    token_idx_N: torch.Tensor
    slot_idx_N: torch.Tensor
    choice_mask_TK: torch.Tensor  # True where the (token, choice) was kept
    num_tokens: int
    num_experts: int
    capacity: int

    @property
    def num_slots(self) -> int:
        return self.num_experts * self.capacity


def make_dispatch_plan(
    expert_idx_TK: torch.Tensor, location_TK: torch.Tensor, num_experts: int, capacity: int
) -> DispatchPlan:
    num_tokens, top_k = expert_idx_TK.shape
    kept_TK = location_TK < capacity
    token_TK = torch.arange(num_tokens, device=expert_idx_TK.device).unsqueeze(1).expand(-1, top_k)
    return DispatchPlan(
        token_idx_N=token_TK[kept_TK],
        slot_idx_N=(expert_idx_TK * capacity + location_TK)[kept_TK],
        choice_mask_TK=kept_TK,
        num_tokens=num_tokens,
        num_experts=num_experts,
        capacity=capacity,
    )


class _FastEncode(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x_TM: torch.Tensor, token_idx_N: torch.Tensor, slot_idx_N: torch.Tensor,
        num_slots: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(token_idx_N, slot_idx_N)
        ctx.num_tokens = x_TM.shape[0]
        buffer_SM = x_TM.new_zeros((num_slots, x_TM.shape[1]))
        buffer_SM.index_copy_(0, slot_idx_N, x_TM.index_select(0, token_idx_N))
        return buffer_SM

    @staticmethod
    def backward(ctx: FunctionCtx, grad_SM: torch.Tensor):  # type: ignore[override]
        token_idx_N, slot_idx_N = ctx.saved_tensors
        grad_x_TM = grad_SM.new_zeros((ctx.num_tokens, grad_SM.shape[1]))
        grad_x_TM.index_add_(0, token_idx_N, grad_SM.index_select(0, slot_idx_N))
        return grad_x_TM, None, None, None


class _FastDecode(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, buffer_SM: torch.Tensor, weight_N: torch.Tensor,
        token_idx_N: torch.Tensor, slot_idx_N: torch.Tensor, num_tokens: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(buffer_SM, weight_N, token_idx_N, slot_idx_N)
        weighted_NM = buffer_SM.index_select(0, slot_idx_N) * weight_N.unsqueeze(1)
        y_TM = buffer_SM.new_zeros((num_tokens, buffer_SM.shape[1]))
        return y_TM.index_add_(0, token_idx_N, weighted_NM)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_TM: torch.Tensor):  # type: ignore[override]
        buffer_SM, weight_N, token_idx_N, slot_idx_N = ctx.saved_tensors
        grad_NM = grad_TM.index_select(0, token_idx_N)
        grad_buffer = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_buffer = torch.zeros_like(buffer_SM)
            grad_buffer.index_copy_(0, slot_idx_N, grad_NM * weight_N.unsqueeze(1))
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_NM * buffer_SM.index_select(0, slot_idx_N)).sum(dim=1)
        return grad_buffer, grad_weight, None, None, None


def encode(x_TM: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Scatter kept token copies into the expert buffer (E, C, M); empty slots are zero."""
    buffer_SM = _FastEncode.apply(x_TM, plan.token_idx_N, plan.slot_idx_N, plan.num_slots)
    return buffer_SM.view(plan.num_experts, plan.capacity, x_TM.shape[1])


def decode(buffer_ECM: torch.Tensor, weights_TK: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Weighted gather back to tokens: y_t = sum over kept choices of w_tj * buffer[slot_tj]."""
    weight_N = weights_TK[plan.choice_mask_TK].to(buffer_ECM.dtype)
    buffer_SM = buffer_ECM.reshape(plan.num_slots, buffer_ECM.shape[-1])
    return _FastDecode.apply(buffer_SM, weight_N, plan.token_idx_N, plan.slot_idx_N, plan.num_tokens)
