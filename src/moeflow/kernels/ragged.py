"""Ragged expert computation: each expert runs on exactly the slots that hold a token.

The padded kernels multiply every local expert's whole capacity, C slots per source rank, however
few of them are filled: at decode's handful of tokens that reads every expert's weights to use a
few. Here the filled slots are gathered into one packed (N, M) matrix ordered by expert, the FFN
runs as a grouped GEMM over the experts' rows (experts with no row are skipped: their weights are
never read), and the rows are scattered back into the padded layout.

Two backends compute the grouped GEMMs. ``torch``: on CPU, torch's own grouped GEMM
(``torch._grouped_mm``: bit-identical to a loop of ``mm`` here, skips empty experts' weights as the
loop does, and was never slower on the CPUs measured: 1.01-1.28x) unless few experts hold rows
(decode's tokens: its kernel still visits every empty group), elsewhere one ``mm`` per expert
that has rows; its weight gradients one ``mm`` per expert. ``triton``
(:mod:`moeflow.kernels.triton_gemm`): one launch per GEMM. With either the backward is ragged as
well (the packed activations are saved, not padded ones), so the dropless path never multiplies
padding in either direction: on the 2-core VM, forward + backward of 4 experts x 2920 slots
(M = 512, H = 1024) ran 1.02-1.04x the padded ``bmm`` kernel full, 1.6x at a Zipf-like fill
(100/60/35/25 %) and 3.2-3.7x at 30 %. Until 2026-11-26 the torch backend's backward was the
padded one (the simulator's ``padded_backward`` plan flag models it for the records of then).

The row indices are built on the host from the exchanged counts (host tensors) and sent from
pinned memory with ``non_blocking`` (:func:`~moeflow.core.device_copy.to_device`): a chunk on
CUDA issues no host sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeflow.core.device_copy import to_device
from moeflow.core.expert_views import ExpertWeights
from moeflow.core.experts import (
    Activation,
    FFNCompute,
    FFNSaved,
    FFNWeightGradInputs,
    FFNWeights,
    activate,
    activate_,
    activation_grad,
    gated_grads,
    up_input,
)
from moeflow.core.workspace import Workspace


@dataclass(frozen=True)
class FilledRows:
    """Which rows of an (L, W*c, M) chunk hold tokens: their flat indices, ordered by expert."""

    index_N: torch.Tensor
    counts_L: torch.Tensor  # rows per local expert
    experts: list[int]  # the local experts that have rows, in order
    counts: list[int]  # their row counts
    _on_device: dict[tuple[str, str], torch.Tensor] = dataclasses.field(default_factory=dict, repr=False,
                                                                         compare=False)  # host values, copied

    def expert_of_rows(self) -> torch.Tensor:
        """The local expert of every packed row (to add per-expert biases)."""
        return torch.repeat_interleave(torch.arange(self.counts_L.numel(), device=self.counts_L.device), self.counts_L)

    @property
    def few_filled(self) -> bool:
        """At most 1/:data:`SPARSE_FILL` of the experts hold rows: a loop over them beats the grouped GEMM."""
        return len(self.experts) * SPARSE_FILL <= self.counts_L.numel()

    def offsets(self) -> torch.Tensor:
        """Where each expert's rows end (``torch._grouped_mm``'s ``offs``)."""
        return torch.cumsum(self.counts_L, 0).to(torch.int32)

    def offsets_on(self, device: torch.device) -> torch.Tensor:
        """:meth:`offsets` on ``device``, copied once per rows (a step's nine grouped GEMMs share them)."""
        return self._copied("offsets", self.offsets, device)

    def expert_of_rows_on(self, device: torch.device) -> torch.Tensor:
        """:meth:`expert_of_rows` on ``device``, copied once per rows (the biases' adds and gradients)."""
        return self._copied("expert_of_rows", self.expert_of_rows, device)

    def _copied(self, name: str, host: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        if key not in self._on_device:
            self._on_device[key] = to_device(host(), device)
        return self._on_device[key]

    @staticmethod
    def of(filled_LW: torch.Tensor, start: int, stop: int) -> FilledRows:
        slots = stop - start
        per_source_LW = (filled_LW - start).clamp(0, slots)
        mask_LWc = torch.arange(slots, device=filled_LW.device) < per_source_LW.unsqueeze(-1)
        return FilledRows.counted(mask_LWc.flatten().nonzero().squeeze(1), per_source_LW.sum(1))

    @staticmethod
    def of_experts(expert_N: torch.Tensor, num_experts: int) -> FilledRows:
        """The rows of a packed matrix already ordered by expert (``expert_N`` non-decreasing)."""
        index_N = torch.arange(expert_N.numel(), device=expert_N.device)
        return FilledRows.counted(index_N, torch.bincount(expert_N, minlength=num_experts))

    @staticmethod
    def counted(index_N: torch.Tensor, counts_L: torch.Tensor) -> FilledRows:
        filled = [(expert, count) for expert, count in enumerate(counts_L.tolist()) if count]
        return FilledRows(index_N, counts_L, [e for e, _ in filled], [c for _, c in filled])


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes


GROUPED_MM_CPU_SINCE = (2, 9)  # torch 2.8 has the op but no CPU kernel
_HAS_CPU_GROUPED_MM = (torch.torch_version.TorchVersion(torch.__version__) >= GROUPED_MM_CPU_SINCE
                       and hasattr(torch, "_grouped_mm"))  # read once: parsing the version cost 20 µs a call


SPARSE_FILL = 4
"""With at most 1/SPARSE_FILL of the experts holding rows, the loop over them beats
``torch._grouped_mm``, whose CPU kernel visits every group: at E = 64 (M = 512, H = 512), one token's
8 experts ran 0.43 ms looped against 0.61 ms grouped; from 16 experts with rows the two were within
10 %."""


def _grouped_mm_layout(tensor: torch.Tensor) -> bool:
    """What ``torch._grouped_mm`` asks of an operand (a conservative reading of its checks): of the
    last two strides one is 1, the other spans the dimension and a multiple of 16 bytes (an fp32
    model dimension of 6 does not), and the data starts on 16 bytes."""
    (rows, cols), (row_stride, col_stride) = tensor.shape[-2:], tensor.stride()[-2:]
    step = 16 // tensor.element_size()
    row_major = col_stride == 1 and row_stride % step == 0 and row_stride >= max(1, cols)
    col_major = row_stride == 1 and col_stride % step == 0 and col_stride >= max(1, rows)
    return (row_major or col_major) and tensor.data_ptr() % 16 == 0


def torch_grouped_mm_runs(a_NK: torch.Tensor, b_LKJ: torch.Tensor) -> bool:
    """Whether the ``torch`` backend runs ``torch._grouped_mm`` for this product: on CPU only
    (measured there; on CUDA ``kernel_backend="auto"`` measures it as the ``grouped_mm`` backend), on
    a torch with its CPU kernel, in the dtypes and layouts it takes. Like the loop's ``mm(out=)`` it
    is not differentiated: it runs inside the experts' autograd function."""
    on_cpu = all(operand.device.type == "cpu" and operand.dtype in GROUPED_MM_DTYPES for operand in (a_NK, b_LKJ))
    return on_cpu and _HAS_CPU_GROUPED_MM and grouped_mm_layouts(a_NK, b_LKJ)


def ragged_mm(a_NK: torch.Tensor, b_LKJ: torch.Tensor, rows: FilledRows, backend: str = "torch") -> torch.Tensor:
    """Rows of expert l (``rows.counts_L[l]`` of them, in order) times ``b_LKJ[l]``, as (N, J).
    ``backend``: one of :data:`moeflow.kernels.choice.GEMM_BACKENDS`."""
    if backend == "triton":
        from moeflow.kernels.triton_gemm import grouped_mm

        return grouped_mm(a_NK, b_LKJ, rows.counts_L)
    grouped = a_NK.shape[0] > 0 and ((backend == "grouped_mm" and grouped_mm_layouts(a_NK, b_LKJ)) or (
        not rows.few_filled and torch_grouped_mm_runs(a_NK, b_LKJ)))
    if grouped:
        return torch._grouped_mm(a_NK, b_LKJ, offs=rows.offsets_on(a_NK.device))
    return looped_mm(a_NK, b_LKJ, rows)


def grouped_mm_layouts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether both operands suit ``torch._grouped_mm`` and the output's rows span 16 bytes (so it is
    contiguous, like the loop's); the device and dtype are the caller's to check
    (:func:`moeflow.kernels.choice.grouped_mm_works`, :func:`torch_grouped_mm_runs`)."""
    return _grouped_mm_layout(a) and _grouped_mm_layout(b) and b.shape[-1] % (16 // b.element_size()) == 0


def looped_mm(a_NK: torch.Tensor, b_LKJ: torch.Tensor, rows: FilledRows) -> torch.Tensor:
    """:func:`ragged_mm` as one ``mm`` per expert that has rows (any device, any torch)."""
    out = a_NK.new_empty((a_NK.shape[0], b_LKJ.shape[2]))
    for expert, a, y in zip(rows.experts, a_NK.split(rows.counts), out.split(rows.counts), strict=True):
        torch.mm(a, b_LKJ[expert], out=y)  # index only the experts with rows (unbind makes all L views)
    return out


def ragged_weight_grad(
    a_NK: torch.Tensor, g_NJ: torch.Tensor, rows: FilledRows, backend: str = "torch"
) -> torch.Tensor:
    """(L, K, J): each expert's rows of a, transposed, times its rows of g; zeros for an expert with none."""
    if backend == "triton":
        from moeflow.kernels.triton_gemm import grouped_weight_grad

        return grouped_weight_grad(a_NK, g_NJ, rows.counts_L)
    if backend == "grouped_mm" and a_NK.shape[0] > 0 and grouped_mm_layouts(a_NK.t(), g_NJ):
        out = torch._grouped_mm(a_NK.t(), g_NJ, offs=rows.offsets_on(a_NK.device))
        if len(rows.experts) < rows.counts_L.numel():  # an expert with no rows: zeros, whatever the kernel left
            empty = [e for e, count in enumerate(rows.counts_L.tolist()) if not count]
            out.index_fill_(0, to_device(torch.tensor(empty), out.device), 0)  # an indexed store syncs
        return out
    out = a_NK.new_zeros((rows.counts_L.numel(), a_NK.shape[1], g_NJ.shape[1]))
    for expert, a, g in zip(rows.experts, a_NK.split(rows.counts), g_NJ.split(rows.counts), strict=True):
        torch.mm(a.t(), g, out=out[expert])
    return out


def packed_ffn(
    x_NM: torch.Tensor, rows: FilledRows, weights: FFNWeights, activation: Activation, backend: str = "torch",
    adds_output_bias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The FFN of packed rows ordered by expert: y, and h, a and up (what a backward reads)."""
    has_bias = any(bias is not None for bias in (weights.b1, weights.b2, weights.b3))
    expert_N = rows.expert_of_rows_on(x_NM.device) if has_bias else None
    h_NH = ragged_mm(x_NM, weights.w1, rows, backend)
    if weights.b1 is not None:
        h_NH.add_(weights.b1.index_select(0, expert_N))  # h is the GEMM's own new tensor
    a_NH = activate(activation, h_NH, torch.empty_like(h_NH))
    up_NH = None if weights.w3 is None else ragged_mm(x_NM, weights.w3, rows, backend)
    if weights.b3 is not None:
        up_NH.add_(weights.b3.index_select(0, expert_N))
    y_NM = ragged_mm(a_NH if up_NH is None else a_NH * up_input(activation, up_NH), weights.w2, rows, backend)
    if weights.b2 is not None and adds_output_bias:
        y_NM.add_(weights.b2.index_select(0, expert_N))
    return y_NM, h_NH, a_NH, up_NH


def expert_rows_ffn(
    x_RM: torch.Tensor, expert_weights: ExpertWeights, activation: Activation, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One expert's FFN on its rows without autograd, all its steps before the next expert's (its
    intermediates stay in cache), the activation in place; into ``out`` when given.
    ``expert_weights``: the expert's own (:meth:`FFNWeights.per_expert`)."""
    w1, b1, w2, b2, w3, b3 = expert_weights
    h_RH = torch.mm(x_RM, w1)
    if b1 is not None:
        h_RH += b1
    a_RH = activate_(activation, h_RH)
    if w3 is not None:
        a_RH *= up_input(activation, torch.mm(x_RM, w3) if b3 is None else torch.addmm(b3, x_RM, w3))
    y_RM = torch.mm(a_RH, w2) if out is None else torch.mm(a_RH, w2, out=out)
    if b2 is not None:
        y_RM += b2
    return y_RM


def packed_ffn_output(
    x_NM: torch.Tensor, rows: FilledRows, weights: FFNWeights, activation: Activation, backend: str = "torch",
) -> torch.Tensor:
    """The FFN's output alone (no backward will read h, a or up): the grouped steps of
    :func:`packed_ffn` where many experts hold rows, else one expert after the other (on CPU a few
    experts' loop issues fewer ops)."""
    if backend == "triton" or x_NM.device.type != "cpu" or not rows.few_filled:
        return packed_ffn(x_NM, rows, weights, activation, backend)[0]
    y_NM = x_NM.new_empty((x_NM.shape[0], weights.w2.shape[2]))
    per_expert = weights.per_expert()
    for expert, x_RM, y_RM in zip(rows.experts, x_NM.split(rows.counts), y_NM.split(rows.counts), strict=True):
        expert_rows_ffn(x_RM, per_expert[expert], activation, out=y_RM)
    return y_NM


def _per_expert_sum(values_NX: torch.Tensor, rows: FilledRows) -> torch.Tensor:
    """Each expert's rows summed, zeros for an expert with none. On a GPU one (L, N) one-hot product
    (a column sum per expert took 22 µs each on an H200, 2.9 ms of a 64-expert layer's step); on a
    CPU one column sum per expert with rows (the product would multiply L times the work)."""
    if values_NX.device.type != "cpu":
        expert_N = rows.expert_of_rows_on(values_NX.device)
        one_hot_LN = values_NX.new_zeros((rows.counts_L.numel(), values_NX.shape[0]))
        one_hot_LN.scatter_(0, expert_N.unsqueeze(0), 1)
        return one_hot_LN @ values_NX
    out = values_NX.new_zeros((rows.counts_L.numel(), values_NX.shape[1]))
    for expert, values in zip(rows.experts, values_NX.split(rows.counts), strict=True):
        torch.sum(values, dim=0, out=out[expert])
    return out


@dataclass(frozen=True)
class RaggedSaved:
    """The packed activations of one chunk (what a ragged backward reads) and where its rows sit."""

    rows: FilledRows
    padded_shape: tuple[int, int, int] | None  # (L, W*c, M) of the chunk; None: the rows were packed already
    x_NM: torch.Tensor
    h_NH: torch.Tensor
    a_NH: torch.Tensor
    up_NH: torch.Tensor | None


@dataclass(frozen=True)
class RaggedWeightGradInputs:
    """What the ragged weight gradients need: packed rows with their expert, chunk after chunk."""

    expert_N: torch.Tensor
    x_NM: torch.Tensor
    hidden_NH: torch.Tensor
    grad_y_NM: torch.Tensor
    grad_h_NH: torch.Tensor
    grad_up_NH: torch.Tensor | None
    num_experts: int

    @staticmethod
    def concat(parts: list[RaggedWeightGradInputs], workspace: Workspace | None = None) -> RaggedWeightGradInputs:
        """All chunks' rows, regrouped by expert (a stable sort keeps each expert's row order); one
        chunk's rows are grouped already."""
        first = parts[0]
        if len(parts) == 1:
            return first
        expert_N = torch.cat([part.expert_N for part in parts])
        order = torch.sort(expert_N, stable=True).indices

        def cat(name: str) -> torch.Tensor | None:
            tensors = [getattr(part, name) for part in parts]
            if tensors[0] is None:
                return None
            return torch.cat(tensors).index_select(0, to_device(order, tensors[0].device))

        return RaggedWeightGradInputs(
            expert_N[order], *(cat(name) for name in ("x_NM", "hidden_NH", "grad_y_NM", "grad_h_NH", "grad_up_NH")),
            num_experts=first.num_experts,
        )


@dataclass(frozen=True)
class RaggedFFNCompute:
    """An :class:`~moeflow.core.experts.ExpertCompute` over the filled slots only. ``filled_LW[l, w]``
    is how many of source rank w's slots of local expert l hold a token (over the whole capacity);
    ``slots`` the capacity range of the chunk being computed (set by :meth:`chunk`). Without
    ``keeps_activations`` (no backward will run) no saved activations are built."""

    base: FFNCompute
    filled_LW: torch.Tensor
    slots: tuple[int, int] | None = None
    keeps_activations: bool = True
    backend: str = "torch"

    @property
    def projections(self) -> int:
        return self.base.projections

    def chunk(self, start: int, stop: int) -> RaggedFFNCompute:
        return dataclasses.replace(self, slots=(start, stop))

    def of_sources(self, ranks: list[int]) -> RaggedFFNCompute:
        return dataclasses.replace(self, filled_LW=self.filled_LW[:, ranks].contiguous())

    def _rows(self, width: int) -> FilledRows:
        start, stop = self.slots if self.slots is not None else (0, width // self.filled_LW.shape[1])
        return FilledRows.of(self.filled_LW, start, stop)

    def forward(
        self, x_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, FFNSaved | RaggedSaved]:
        experts, width, model = x_LCM.shape
        rows = self._rows(width)
        index_N = to_device(rows.index_N, x_LCM.device)
        x_NM = x_LCM.reshape(-1, model).index_select(0, index_N)
        y_NM, saved = packed_forward(self.base, x_NM, rows, weights, self.backend)

        def padded(values_NX: torch.Tensor) -> torch.Tensor:
            out = values_NX.new_zeros((experts, width, values_NX.shape[1]))
            out.view(-1, values_NX.shape[1]).index_copy_(0, index_N, values_NX)
            return out

        if not self.keeps_activations:
            return padded(y_NM), FFNSaved(x_LCM, x_LCM, x_LCM, None)  # placeholders no backward reads
        return padded(y_NM), dataclasses.replace(saved, padded_shape=(experts, width, model))

    def backward_input(
        self, saved: FFNSaved | RaggedSaved, grad_y_LCM: torch.Tensor, weights: FFNWeights,
        workspace: Workspace | None = None,
    ) -> tuple[torch.Tensor, FFNWeightGradInputs | RaggedWeightGradInputs]:
        if not isinstance(saved, RaggedSaved):
            return self.base.backward_input(saved, grad_y_LCM, weights, workspace)
        rows = saved.rows
        index_N = to_device(rows.index_N, grad_y_LCM.device)
        grad_y_NM = grad_y_LCM.reshape(-1, grad_y_LCM.shape[-1]).index_select(0, index_N)
        grad_x_NM, inputs = packed_backward_input(self.base.activation, saved, grad_y_NM, weights, self.backend)
        assert saved.padded_shape is not None
        grad_x_LCM = grad_x_NM.new_zeros(saved.padded_shape)
        grad_x_LCM.view(-1, grad_x_NM.shape[1]).index_copy_(0, index_N, grad_x_NM)
        return grad_x_LCM, inputs

    def weight_grads(
        self, inputs: FFNWeightGradInputs | RaggedWeightGradInputs, weights: FFNWeights,
        workspace: Workspace | None = None,
    ) -> list[torch.Tensor | None]:
        if not isinstance(inputs, RaggedWeightGradInputs):
            return self.base.weight_grads(inputs, weights, workspace)
        return packed_weight_grads(self.base, inputs, FilledRows.of_experts(inputs.expert_N, inputs.num_experts),
                                   weights, self.backend)


def packed_forward(
    base: FFNCompute, x_NM: torch.Tensor, rows: FilledRows, weights: FFNWeights, backend: str
) -> tuple[torch.Tensor, RaggedSaved]:
    """The FFN of packed rows ordered by expert, and what its backward reads."""
    y_NM, h_NH, a_NH, up_NH = packed_ffn(x_NM, rows, weights, base.activation, backend, base.adds_output_bias)
    return y_NM, RaggedSaved(rows, None, x_NM, h_NH, a_NH, up_NH)


def packed_backward_input(
    activation: Activation, saved: RaggedSaved, grad_y_NM: torch.Tensor, weights: FFNWeights, backend: str
) -> tuple[torch.Tensor, RaggedWeightGradInputs]:
    """The packed rows' input gradient, and what their weight gradients read."""
    rows = saved.rows
    up_in_NH = None if saved.up_NH is None else up_input(activation, saved.up_NH)
    hidden_NH = saved.a_NH if up_in_NH is None else saved.a_NH * up_in_NH
    grad_a_NH = ragged_mm(grad_y_NM, weights.w2.transpose(1, 2), rows, backend)
    grad_up_NH = None
    if saved.up_NH is not None and up_in_NH is not None:  # grad_a: the GEMM's own tensor
        grad_up_NH = gated_grads(activation, grad_a_NH, saved.a_NH, saved.up_NH, up_in_NH)
    grad_h_NH = activation_grad(activation, grad_a_NH, saved.h_NH, torch.empty_like(grad_a_NH))
    grad_x_NM = ragged_mm(grad_h_NH, weights.w1.transpose(1, 2), rows, backend)
    if grad_up_NH is not None:
        assert weights.w3 is not None
        grad_x_NM.add_(ragged_mm(grad_up_NH, weights.w3.transpose(1, 2), rows, backend))  # a new tensor: in place
    inputs = RaggedWeightGradInputs(rows.expert_of_rows(), saved.x_NM, hidden_NH, grad_y_NM, grad_h_NH,
                                    grad_up_NH, rows.counts_L.numel())
    return grad_x_NM, inputs


def packed_weight_grads(
    base: FFNCompute, inputs: RaggedWeightGradInputs, rows: FilledRows, weights: FFNWeights, backend: str
) -> list[torch.Tensor | None]:
    """[grad w1, b1, w2, b2, w3, b3] of packed rows ordered by expert (``rows``)."""
    grad_w1 = ragged_weight_grad(inputs.x_NM, inputs.grad_h_NH, rows, backend)
    grad_w2 = ragged_weight_grad(inputs.hidden_NH, inputs.grad_y_NM, rows, backend)
    grad_w3 = None
    if inputs.grad_up_NH is not None:
        grad_w3 = ragged_weight_grad(inputs.x_NM, inputs.grad_up_NH, rows, backend)
    return base.all_grads(weights, grad_w1, grad_w2, grad_w3, lambda rows_NX: _per_expert_sum(rows_NX, rows),
                          inputs.grad_h_NH, inputs.grad_y_NM, inputs.grad_up_NH)
