"""Ragged expert computation: each expert runs on exactly the slots that hold a token.

The padded kernels multiply every local expert's whole capacity, C slots per source rank, however
few of them are filled: at decode's handful of tokens that reads every expert's weights to use a
few. Here the filled slots are gathered into one packed (N, M) matrix ordered by expert, the FFN
runs as one GEMM per expert on its rows (experts with no row are skipped: their weights are never
read), and the rows are scattered back into the padded layout. torch's CPU grouped GEMM
(``torch._grouped_mm``) is not used: it runs a GEMM for every expert, empty ones included.

The backward is the padded one: the saved activations are scattered into zero-filled padded
buffers and the gradient of an empty slot is zero, so the padded GEMMs give the same gradients.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeflow.experts import FFNCompute, FFNSaved, FFNWeightGradInputs, FFNWeights, activate
from moeflow.workspace import Workspace


@dataclass(frozen=True)
class FilledRows:
    """Which rows of an (L, W*c, M) chunk hold tokens: their flat indices, ordered by expert."""

    index_N: torch.Tensor
    counts_L: torch.Tensor  # rows per local expert
    experts: list[int]  # the local experts that have rows, in order
    counts: list[int]  # their row counts

    def expert_of_rows(self) -> torch.Tensor:
        """The local expert of every packed row (to add per-expert biases)."""
        return torch.repeat_interleave(torch.arange(self.counts_L.numel()), self.counts_L)

    @staticmethod
    def of(filled_LW: torch.Tensor, start: int, stop: int) -> FilledRows:
        slots = stop - start
        per_source_LW = (filled_LW - start).clamp(0, slots)
        mask_LWc = torch.arange(slots) < per_source_LW.unsqueeze(-1)
        counts_L = per_source_LW.sum(1)
        filled = [(expert, count) for expert, count in enumerate(counts_L.tolist()) if count]
        return FilledRows(mask_LWc.flatten().nonzero().squeeze(1), counts_L, [e for e, _ in filled],
                          [c for _, c in filled])


def ragged_mm(a_NK: torch.Tensor, b_LKJ: torch.Tensor, rows: FilledRows) -> torch.Tensor:
    """Rows of expert l (``rows.counts_L[l]`` of them, in order) times ``b_LKJ[l]``, as (N, J): one
    GEMM per expert that has rows (torch's CPU grouped GEMM also visits the empty ones)."""
    out = a_NK.new_empty((a_NK.shape[0], b_LKJ.shape[2]))
    for expert, a, y in zip(rows.experts, a_NK.split(rows.counts), out.split(rows.counts), strict=True):
        torch.mm(a, b_LKJ[expert], out=y)  # index only the experts with rows (unbind makes all L views)
    return out


@dataclass(frozen=True)
class RaggedFFNCompute:
    """An :class:`~moeflow.experts.ExpertCompute` over the filled slots only. ``filled_LW[l, w]``
    is how many of source rank w's slots of local expert l hold a token (over the whole capacity);
    ``slots`` the capacity range of the chunk being computed (set by :meth:`chunk`). Without
    ``keeps_activations`` (no backward will run) the padded saved activations are not built."""

    base: FFNCompute
    filled_LW: torch.Tensor
    slots: tuple[int, int] | None = None
    keeps_activations: bool = True

    @property
    def projections(self) -> int:
        return self.base.projections

    def chunk(self, start: int, stop: int) -> RaggedFFNCompute:
        return dataclasses.replace(self, slots=(start, stop))

    def of_sources(self, ranks: list[int]) -> RaggedFFNCompute:
        return dataclasses.replace(self, filled_LW=self.filled_LW[:, ranks].contiguous())

    def forward(
        self, x_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, FFNSaved]:
        experts, width, model = x_LCM.shape
        sources = self.filled_LW.shape[1]
        start, stop = self.slots if self.slots is not None else (0, width // sources)
        rows = FilledRows.of(self.filled_LW, start, stop)
        x_NM = x_LCM.reshape(-1, model).index_select(0, rows.index_N)
        h_NH = ragged_mm(x_NM, weights.w1, rows)
        if weights.b1 is not None:
            h_NH = h_NH + weights.b1[rows.expert_of_rows()]
        a_NH = activate(self.base.activation, h_NH, torch.empty_like(h_NH))
        up_NH = None if weights.w3 is None else ragged_mm(x_NM, weights.w3, rows)
        y_NM = ragged_mm(a_NH if up_NH is None else a_NH * up_NH, weights.w2, rows)
        if weights.b2 is not None and self.base.adds_output_bias:
            y_NM = y_NM + weights.b2[rows.expert_of_rows()]

        def padded(values_NX: torch.Tensor) -> torch.Tensor:
            out = values_NX.new_zeros((experts, width, values_NX.shape[1]))
            out.view(-1, values_NX.shape[1]).index_copy_(0, rows.index_N, values_NX)
            return out

        if not self.keeps_activations:
            return padded(y_NM), FFNSaved(x_LCM, x_LCM, x_LCM, None)  # placeholders no backward reads
        up_LCH = None if up_NH is None else padded(up_NH)
        return padded(y_NM), FFNSaved(x_LCM, padded(h_NH), padded(a_NH), up_LCH)

    def backward_input(
        self, saved: FFNSaved, grad_y_LCM: torch.Tensor, weights: FFNWeights, workspace: Workspace | None = None
    ) -> tuple[torch.Tensor, FFNWeightGradInputs]:
        return self.base.backward_input(saved, grad_y_LCM, weights, workspace)

    def weight_grads(
        self, inputs: FFNWeightGradInputs, weights: FFNWeights, workspace: Workspace | None = None
    ) -> list[torch.Tensor | None]:
        return self.base.weight_grads(inputs, weights, workspace)
