"""Batched expert FFNs: all local experts in a few large GEMMs, with a hand-written backward.

Shapes: L local experts, C tokens per expert (W*C after dispatch), M model dim, H hidden dim.
Parameters ``w1`` (L, M, H), ``b1`` (L, H), ``w2`` (L, H, M), ``b2`` (L, M), and for swiglu ``w3``
(L, M, H) and ``b3`` (L, H): swiglu(x) = (silu(x w1 + b1) * (x w3 + b3)) w2 + b2.

Each GEMM runs either as one ``bmm`` over all experts or as one ``mm`` per expert written in place
(``loop``); both compute the same function. Measured on the 2-core CPU (one thread, allocator
tuned, interleaved medians) both run at the same rate, 72-88 GFLOP/s, for E=8..64 experts of
128..1024 tokens; ``bmm`` issues fewer ops and is the default, and ``moeflow bench layer`` times
both in every run. The backward is explicit: one autograd node for the whole FFN that saves only
what it needs and computes each gradient GEMM once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.config import ACTIVATIONS, EXPERT_KERNELS, ffn_projections
from moeflow.core.clamped_swiglu import ClampedSwiGLU
from moeflow.core.expert_views import ExpertViews, ExpertWeights
from moeflow.core.workspace import Workspace
from moeflow.core.workspace import buffer as _buffer

KERNELS = EXPERT_KERNELS
Activation = str | ClampedSwiGLU
"""What an expert's compute applies to ``x w1 + b1``: a name (``"silu"`` for SwiGLU's gate half), or a
:class:`ClampedSwiGLU` (gpt-oss's experts)."""
Ran = TypeVar("Ran", bound=tuple)
"""What :meth:`ExpertFFN.run_with_weights` returns: a tuple whose first item is the output."""


def batched_mm(
    a_LIK: torch.Tensor, b_LKJ: torch.Tensor, loop: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(L, I, K) @ (L, K, J) -> (L, I, J), as one bmm or as L mm's, written into ``out`` if given."""
    if out is None:
        out = a_LIK.new_empty((a_LIK.shape[0], a_LIK.shape[1], b_LKJ.shape[2]))
    if not loop:
        return torch.bmm(a_LIK, b_LKJ, out=out)
    for e in range(a_LIK.shape[0]):
        torch.mm(a_LIK[e], b_LKJ[e], out=out[e])
    return out


def activate(name: Activation, h_LCH: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if isinstance(name, ClampedSwiGLU):
        return name.gate(h_LCH, out)
    if name == "relu":
        return torch.clamp(h_LCH, min=0, out=out)
    if name == "gelu":
        return torch.ops.aten.gelu.out(h_LCH, out=out)  # exact erf form, torch's default
    return torch.ops.aten.silu.out(h_LCH, out=out)  # silu, and the gate half of swiglu


def activate_(name: Activation, h: torch.Tensor) -> torch.Tensor:
    """:func:`activate` in place, through the functional calls (``torch.ops`` costs about 10 µs a call
    more, which a one-token forward pays once per expert)."""
    if isinstance(name, ClampedSwiGLU):
        return name.gate(h)
    if name == "relu":
        return h.relu_()
    if name == "gelu":
        return torch._C._nn.gelu_(h)  # exact erf form, as activate
    return torch.nn.functional.silu(h, inplace=True)


def activation_grad(name: Activation, grad_LCH: torch.Tensor, h_LCH: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if isinstance(name, ClampedSwiGLU):
        return name.gate_grad(grad_LCH, h_LCH, out)
    if name == "relu":
        return torch.mul(grad_LCH, h_LCH > 0, out=out)
    if name == "gelu":
        return torch.ops.aten.gelu_backward.grad_input(grad_LCH, h_LCH, grad_input=out)
    return torch.ops.aten.silu_backward.grad_input(grad_LCH, h_LCH, grad_input=out)


def up_input(name: Activation, up: torch.Tensor) -> torch.Tensor:
    """What multiplies the gate half: SwiGLU's ``x w3`` itself, or its clamped and offset value."""
    return name.up(up) if isinstance(name, ClampedSwiGLU) else up


def gated_grads(
    name: Activation, grad_hidden: torch.Tensor, a: torch.Tensor, up: torch.Tensor, up_in: torch.Tensor,
    grad_up_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of ``x w3`` (the raw ``up``) from that of ``a * up_in`` (``up_in``: :func:`up_input`
    of ``up``, as the forward multiplied); ``grad_hidden`` becomes, in place, the gradient of ``a``."""
    grad_up = torch.mul(grad_hidden, a, out=grad_up_out)
    if isinstance(name, ClampedSwiGLU):
        name.up_grad_(grad_up, up)
    grad_hidden.mul_(up_in)
    return grad_up


@dataclass(frozen=True)
class FFNWeights:
    """The parameters of L experts as plain tensors; the biases are None for bias-free experts
    (Mixtral, Qwen-MoE, DeepSeek), ``w3`` and ``b3`` are SwiGLU's up projection (gpt-oss's has a bias)."""

    w1: torch.Tensor
    b1: torch.Tensor | None
    w2: torch.Tensor
    b2: torch.Tensor | None
    w3: torch.Tensor | None = None
    b3: torch.Tensor | None = None
    views: ExpertViews | None = field(default=None, compare=False, repr=False)  # the owner's (per_expert)

    def as_tuple(self) -> tuple[torch.Tensor | None, ...]:
        return (self.w1, self.b1, self.w2, self.b2, self.w3, self.b3)

    def cast(self, dtype: torch.dtype) -> FFNWeights:
        """The weights in ``dtype`` (a differentiable cast: gradients return in the original dtype)."""
        if self.w1.dtype == dtype:
            return self
        return FFNWeights(*(None if w is None else w.to(dtype) for w in self.as_tuple()))

    def per_expert(self) -> Sequence[ExpertWeights]:
        """Expert e's (w1, b1, w2, b2, w3, b3) at ``[e]``: the owner's kept views where these are its
        parameters (:class:`~moeflow.core.expert_views.ExpertViews`), else indexed on each read."""
        if self.views is not None:
            return self.views.of(self.as_tuple())
        return _Indexed(self.as_tuple())


class _Indexed:
    """Each expert's weights indexed when read (weights made for one call: a cast, a fetched copy)."""

    def __init__(self, weights: ExpertWeights) -> None:
        self.weights = weights

    def __getitem__(self, expert: int) -> ExpertWeights:
        return tuple(None if w is None else w[expert] for w in self.weights)


@dataclass(frozen=True)
class FFNSaved:
    """What the backward of one forward call needs (one per pipeline chunk)."""

    x_LCM: torch.Tensor
    h_LCH: torch.Tensor  # x w1 + b1
    a_LCH: torch.Tensor  # act(h): the activation output, SwiGLU's gate half
    up_LCH: torch.Tensor | None  # SwiGLU only: x w3


@dataclass(frozen=True)
class FFNWeightGradInputs:
    """What the weight gradients of one backward need; chunks concatenate along dim 1."""

    x_LCM: torch.Tensor
    hidden_LCH: torch.Tensor  # input of w2: act(h), or act(h) * up for SwiGLU
    grad_y_LCM: torch.Tensor
    grad_h_LCH: torch.Tensor
    grad_up_LCH: torch.Tensor | None

    @staticmethod
    def concat(parts: list[FFNWeightGradInputs], workspace: Workspace | None = None) -> FFNWeightGradInputs:
        if len(parts) == 1:
            return parts[0]

        def cat(name: str) -> torch.Tensor:
            tensors = [getattr(part, name) for part in parts]
            first = tensors[0]
            rows = sum(t.shape[1] for t in tensors)
            return torch.cat(tensors, dim=1, out=_buffer(workspace, (first.shape[0], rows, first.shape[2]), first))

        grad_up = cat("grad_up_LCH") if parts[0].grad_up_LCH is not None else None
        return FFNWeightGradInputs(cat("x_LCM"), cat("hidden_LCH"), cat("grad_y_LCM"), cat("grad_h_LCH"), grad_up)


class ExpertCompute(Protocol):
    """What the pipelined autograd node calls on one chunk of a block of local experts: the
    forward, the input gradient (sent on at once), and the weight gradients (deferred, over all
    chunks). Stateless: everything per chunk travels in the returned records."""

    projections: int

    def chunk(self, start: int, stop: int) -> ExpertCompute:
        """The compute of the capacity slots [start, stop) (ragged kernels skip the empty ones)."""
        ...

    def of_sources(self, ranks: list[int]) -> ExpertCompute:
        """The compute of the rows that came from these source ranks (in this order)."""
        ...

    def forward(
        self, x_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, FFNSaved]: ...

    def backward_input(
        self, saved: FFNSaved, grad_y_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, FFNWeightGradInputs]: ...

    def weight_grads(
        self, inputs: FFNWeightGradInputs, weights: FFNWeights, workspace: Workspace | None = None
    ) -> list[torch.Tensor | None]: ...


@dataclass(frozen=True)
class FFNCompute:
    """y = act(x w1 + b1) w2 + b2, biases optional. ``adds_output_bias=False`` is a hidden shard
    other than the first: its partial output is summed with the others, which add b2 once."""

    activation: Activation = "gelu"
    kernel: str = "bmm"
    adds_output_bias: bool = True
    projections: int = 2
    weight_grad_scale: float = 1.0  # < 1 where a schedule runs the same slots on several copies

    def chunk(self, start: int, stop: int) -> FFNCompute:
        return self  # the padded kernels compute every slot

    def of_sources(self, ranks: list[int]) -> FFNCompute:
        return self

    def forward(
        self, x_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, FFNSaved]:
        """y and what the backward needs; y, h, a (and up) come from ``workspace`` when given."""
        loop = self.kernel == "loop"  # "ragged" runs here only without its filled counts: as "bmm"
        rows, hidden, model = x_LCM.shape[:2], weights.w1.shape[2], weights.w2.shape[2]
        h_LCH = batched_mm(x_LCM, weights.w1, loop, _buffer(workspace, (*rows, hidden), x_LCM))
        if weights.b1 is not None:
            h_LCH.add_(weights.b1.unsqueeze(1))
        a_LCH = activate(self.activation, h_LCH, _buffer(workspace, (*rows, hidden), x_LCM))
        up_LCH = self._up(x_LCM, weights, workspace)
        hidden_LCH = a_LCH if up_LCH is None else torch.mul(
            a_LCH, up_input(self.activation, up_LCH), out=_buffer(workspace, a_LCH.shape, a_LCH))
        y_LCM = batched_mm(hidden_LCH, weights.w2, loop, _buffer(workspace, (*rows, model), x_LCM))
        if weights.b2 is not None and self.adds_output_bias:
            y_LCM.add_(weights.b2.unsqueeze(1))
        return y_LCM, FFNSaved(x_LCM, h_LCH, a_LCH, up_LCH)

    def backward_input(
        self, saved: FFNSaved, grad_y_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, FFNWeightGradInputs]:
        loop = self.kernel == "loop"
        up_LCH, a_LCH = saved.up_LCH, saved.a_LCH
        up_in_LCH = None if up_LCH is None else up_input(self.activation, up_LCH)
        hidden_LCH = a_LCH if up_in_LCH is None else torch.mul(
            a_LCH, up_in_LCH, out=_buffer(workspace, a_LCH.shape, a_LCH))
        grad_a_LCH = batched_mm(grad_y_LCM, weights.w2.transpose(1, 2), loop, _buffer(workspace, a_LCH.shape, a_LCH))
        grad_up_LCH = None
        if up_LCH is not None and up_in_LCH is not None:
            grad_up_LCH = gated_grads(self.activation, grad_a_LCH, a_LCH, up_LCH, up_in_LCH,
                                      _buffer(workspace, a_LCH.shape, a_LCH))
        grad_h_LCH = activation_grad(
            self.activation, grad_a_LCH, saved.h_LCH, _buffer(workspace, a_LCH.shape, a_LCH)
        )
        grad_x_LCM = batched_mm(
            grad_h_LCH, weights.w1.transpose(1, 2), loop, _buffer(workspace, saved.x_LCM.shape, saved.x_LCM)
        )
        if grad_up_LCH is not None:
            assert weights.w3 is not None
            w3_t = weights.w3.transpose(1, 2)
            if loop:
                grad_x_LCM.add_(batched_mm(grad_up_LCH, w3_t, loop))
            else:
                grad_x_LCM.baddbmm_(grad_up_LCH, w3_t)
        return grad_x_LCM, FFNWeightGradInputs(saved.x_LCM, hidden_LCH, grad_y_LCM, grad_h_LCH, grad_up_LCH)

    def weight_grads(
        self, inputs: FFNWeightGradInputs, weights: FFNWeights, workspace: Workspace | None = None
    ) -> list[torch.Tensor | None]:
        """[grad w1, b1, w2, b2, w3, b3], each one GEMM (or sum) over all rows; None where absent. With
        a ``workspace`` the large ones reuse storage that no earlier gradient still uses."""
        loop = self.kernel == "loop"

        def grad_of(weight: torch.Tensor, a_LKI: torch.Tensor, b_LIJ: torch.Tensor) -> torch.Tensor:
            return batched_mm(a_LKI.transpose(1, 2), b_LIJ, loop, _buffer(workspace, weight.shape, weight))

        grad_w2 = grad_of(weights.w2, inputs.hidden_LCH, inputs.grad_y_LCM)
        grad_w1 = grad_of(weights.w1, inputs.x_LCM, inputs.grad_h_LCH)
        grad_w3 = None
        if inputs.grad_up_LCH is not None:
            assert weights.w3 is not None
            grad_w3 = grad_of(weights.w3, inputs.x_LCM, inputs.grad_up_LCH)
        return self.all_grads(weights, grad_w1, grad_w2, grad_w3, lambda rows_LCX: rows_LCX.sum(dim=1),
                              inputs.grad_h_LCH, inputs.grad_y_LCM, inputs.grad_up_LCH)

    def all_grads(
        self, weights: FFNWeights, grad_w1: torch.Tensor, grad_w2: torch.Tensor, grad_w3: torch.Tensor | None,
        sum_per_expert: Callable[[torch.Tensor], torch.Tensor], grad_h: torch.Tensor, grad_y: torch.Tensor,
        grad_up: torch.Tensor | None = None,
    ) -> list[torch.Tensor | None]:
        """[grad w1, b1, w2, b2, w3, b3] from the weight gradients and the per-expert row sums of the
        hidden, output and up gradients (the biases'), scaled by ``weight_grad_scale``; the padded and
        ragged layouts differ only in how rows are summed per expert."""
        grad_b1 = sum_per_expert(grad_h) if weights.b1 is not None else None
        grad_b2 = None
        if weights.b2 is not None:
            grad_b2 = sum_per_expert(grad_y) if self.adds_output_bias else torch.zeros_like(weights.b2)
        grad_b3 = sum_per_expert(grad_up) if weights.b3 is not None and grad_up is not None else None
        grads = [grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3]
        if self.weight_grad_scale != 1.0:
            for grad in grads:
                if grad is not None:
                    grad.mul_(self.weight_grad_scale)
        return grads

    def _up(self, x_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None) -> torch.Tensor | None:
        return None


@dataclass(frozen=True)
class SwiGLUCompute(FFNCompute):
    """y = (silu(x w1 + b1) * (x w3 + b3)) w2 + b2: the gated FFN of LLaMA-style experts (a
    :class:`ClampedSwiGLU` as ``activation``: gpt-oss's)."""

    activation: Activation = "silu"
    projections: int = 3

    def _up(self, x_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None) -> torch.Tensor | None:
        assert weights.w3 is not None, "SwiGLU experts need w3"
        out = _buffer(workspace, (*x_LCM.shape[:2], weights.w3.shape[2]), x_LCM)
        up_LCH = batched_mm(x_LCM, weights.w3, self.kernel == "loop", out)
        return up_LCH if weights.b3 is None else up_LCH.add_(weights.b3.unsqueeze(1))


def expert_compute(
    activation: str, kernel: str = "bmm", adds_output_bias: bool = True, clamp: ClampedSwiGLU | None = None
) -> FFNCompute:
    """The :class:`ExpertCompute` of an activation name (``clamp``: SwiGLU's, clamped)."""
    if activation == "swiglu":
        return SwiGLUCompute(kernel=kernel, adds_output_bias=adds_output_bias, activation=clamp or "silu")
    if clamp is not None:
        raise ValueError(f"swiglu_limit clamps SwiGLU experts only; activation={activation!r}: use activation='swiglu'")
    return FFNCompute(activation, kernel, adds_output_bias)


class _ExpertFFNFunction(torch.autograd.Function):
    """The whole FFN as one autograd node: saves only what the backward needs."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x_LCM: torch.Tensor, compute: FFNCompute, w1: torch.Tensor, b1: torch.Tensor | None,
        w2: torch.Tensor, b2: torch.Tensor | None, w3: torch.Tensor | None, b3: torch.Tensor | None,
    ) -> torch.Tensor:
        y_LCM, saved = compute.forward(x_LCM, FFNWeights(w1, b1, w2, b2, w3, b3))
        ctx.save_for_backward(x_LCM, w1, b1, w2, b2, w3, b3, saved.h_LCH, saved.a_LCH, saved.up_LCH)
        ctx.compute = compute
        return y_LCM

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_y_LCM: torch.Tensor):  # type: ignore[override]
        x_LCM, w1, b1, w2, b2, w3, b3, h_LCH, a_LCH, up_LCH = ctx.saved_tensors
        weights = FFNWeights(w1, b1, w2, b2, w3, b3)
        saved = FFNSaved(x_LCM, h_LCH, a_LCH, up_LCH)
        grad_x_LCM, inputs = ctx.compute.backward_input(saved, grad_y_LCM.contiguous(), weights)
        return grad_x_LCM, None, *ctx.compute.weight_grads(inputs, weights)


class LocalExperts(Protocol):
    """What a schedule runs: the local experts' compute, their number and their weights (an
    :class:`ExpertFFN`, or a view of one whose weights carry extra autograd, as redundant slots do)."""

    @property
    def compute(self) -> FFNCompute: ...

    @property
    def num_experts(self) -> int: ...

    def weights(self) -> FFNWeights: ...


class ExpertFFN(nn.Module):
    """``num_experts`` independent FFNs (or hidden shards of them) evaluated together on
    (L, C, M) input; ``bias=False`` gives bias-free experts (no ``b1``/``b2``/``b3``), ``clamp`` clamped
    SwiGLU."""

    def __init__(
        self, num_experts: int, model_dim: int, hidden_dim: int, activation: str = "gelu",
        kernel: str = "bmm", bias: bool = True, initialize: bool = True, clamp: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        if kernel not in KERNELS:
            raise ValueError(f"unknown expert kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        self.activation = activation
        self.kernel = kernel
        self.compute = expert_compute(activation, kernel, clamp=clamp)
        self.expert_views = ExpertViews()  # each expert's weights, for the loops over a few experts
        self.w1 = nn.Parameter(torch.empty(num_experts, model_dim, hidden_dim))
        self.b1 = nn.Parameter(torch.zeros(num_experts, hidden_dim)) if bias else None
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, model_dim))
        self.b2 = nn.Parameter(torch.zeros(num_experts, model_dim)) if bias else None
        self.w3 = (
            nn.Parameter(torch.empty(num_experts, model_dim, hidden_dim)) if activation == "swiglu" else None
        )
        self.b3 = nn.Parameter(torch.zeros(num_experts, hidden_dim)) if bias and self.w3 is not None else None
        if initialize:  # else the owner initializes them (MoELayer: by global expert index)
            self.reset_parameters()

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def reset_parameters(self) -> None:
        model_dim, hidden_dim = self.w1.shape[1], self.w1.shape[2]
        for weight, fan_in in ((self.w1, model_dim), (self.w2, hidden_dim), (self.w3, model_dim)):
            if weight is not None:
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(weight, -bound, bound)
        for bias in (self.b1, self.b2, self.b3):
            if bias is not None:
                nn.init.zeros_(bias)

    def reset_by_expert(
        self, slices: Sequence[tuple[int, int, int]], seed: int, full_hidden: int,
        normal_std: Mapping[str, float] | None = None,
    ) -> None:
        """Initialize local expert i as global expert ``slices[i][0]``'s hidden units
        ``[slices[i][1], slices[i][2])``, drawn from a generator seeded by ``seed`` and that global
        index: expert e is the same on any number of ranks and in any placement, and no rank draws
        another's experts (one whole expert at a time at most). Bounds as ``reset_parameters``, with
        the full hidden size as w2's fan-in; or, with ``normal_std`` (by kind: ``w1``, ``w2``,
        ``w3``), normal weights of that std (GPT-2's initialization)."""
        model_dim = self.w1.shape[1]
        with torch.no_grad():
            for local, (expert, start, stop) in enumerate(slices):
                generator = torch.Generator().manual_seed(expert_seed(seed, expert))
                for kind, weight, shape, axis in (("w1", self.w1, (model_dim, full_hidden), 1),
                                                  ("w2", self.w2, (full_hidden, model_dim), 0),
                                                  ("w3", self.w3, (model_dim, full_hidden), 1)):
                    if weight is None:
                        continue
                    in_place = stop - start == full_hidden  # the slot holds the whole expert: no transient copy
                    whole = weight[local] if in_place else torch.empty(shape)
                    if normal_std is None:
                        bound = 1.0 / math.sqrt(shape[0])
                        whole.uniform_(-bound, bound, generator=generator)
                    else:
                        whole.normal_(0.0, normal_std[kind], generator=generator)
                    if not in_place:
                        weight[local].copy_(whole.narrow(axis, start, stop - start))
            for bias in (self.b1, self.b2, self.b3):
                if bias is not None:
                    bias.zero_()

    def weights(self) -> FFNWeights:
        """The parameters as plain tensors, for code that runs the FFN outside autograd."""
        return FFNWeights(self.w1, self.b1, self.w2, self.b2, self.w3, self.b3, self.expert_views)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """A replaced weight (a move to another placement) drops the kept per-expert views."""
        super().register_parameter(name, param)
        views = self.__dict__.get("expert_views")
        if views is not None:
            views.clear()

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> ExpertFFN:
        """``to()``, ``cuda()`` and the like replace the weights' storage: drop the kept views first."""
        self.expert_views.clear()
        return super()._apply(fn, recurse)

    def run_with_weights(self, x_TM: torch.Tensor, run: Callable[[torch.Tensor], Ran]) -> Ran:
        """``run(x_TM)``: the one call inside which a layer reads these weights (its dispatch's
        experts step: the rows to the experts and back), ``x_TM`` its input rows. A plain call; it
        exists so that a wrapper holding the weights sharded has a seam: FSDP2
        (``register_fsdp_forward_method``) gathers them around it and, after the backward of its
        output reaches ``x_TM``, reduce-scatters their gradients."""
        return run(x_TM)

    def forward(self, x_LCM: torch.Tensor) -> torch.Tensor:
        """In x's dtype: bf16/fp16 input over fp32 parameters casts the weights (mixed precision)."""
        weights = self.weights().cast(x_LCM.dtype)
        return _ExpertFFNFunction.apply(x_LCM.contiguous(), self.compute, *weights.as_tuple())


def shared_output(x_TM: torch.Tensor, shared: ExpertFFN, gate: nn.Linear | None) -> torch.Tensor:
    """The dense shared experts' summed output for every token (Qwen2-MoE: times its sigmoid gate)."""
    shared_TM = shared(x_TM.unsqueeze(0).expand(shared.num_experts, -1, -1)).sum(dim=0)
    if gate is None:
        return shared_TM
    return torch.sigmoid(torch.nn.functional.linear(x_TM, gate.weight.to(x_TM.dtype))) * shared_TM


def expert_seed(seed: int, expert: int) -> int:
    """The generator seed of global expert ``expert`` in a layer seeded with ``seed``."""
    return (seed * 1_000_003 + expert) % (1 << 63)


def ffn_flops(num_tokens: int, model_dim: int, hidden_dim: int, activation: str, backward: bool) -> int:
    """Floating-point work of the expert GEMMs for ``num_tokens`` routed tokens (the roofline's
    compute term); backward costs twice the forward (grad of input and of weight)."""
    forward = 2 * num_tokens * model_dim * hidden_dim * ffn_projections(activation)
    return forward * (3 if backward else 1)
