"""The local dispatcher: a forward on a rank that holds every expert, with no capacity buffer.

Where a forward needs no other rank and runs no backward (generation or evaluation on one
process), the capacity layout is only overhead. Encode scatters the tokens into an (E, C, M)
buffer, the ragged kernel gathers the filled slots out of it and scatters its output back, and
decode gathers once more, while the load exchange and the planner plan a pipeline of one chunk.
Here the k choices of every token are sorted by expert once and their rows gathered straight from
x. The experts run over their rows (:func:`moeflow.kernels.ragged.packed_ffn_output`, which never reads an
empty expert's weights), and each token sums its k rows with its combine weights in one
``embedding_bag``, as decode does. With large intermediates each expert instead gathers and adds
back its own rows (:data:`CACHE_RESIDENT_BYTES`). It computes the same function as the capacity
path wherever that path drops nothing (:func:`moeflow.core.capacity.never_drops`): the same products,
summed over a token's choices in expert order rather than choice order on the large branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeflow.core.experts import Activation, ExpertFFN, FFNWeights
from moeflow.core.routing.router import Routing
from moeflow.core.stats import PipelineTiming
from moeflow.kernels.ragged import FilledRows, expert_rows_ffn, packed_ffn_output
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.dispatchers.protocol import LayerCall
from moeflow.parallel.dispatchers.stats import DirectDispatcher, DirectLabels

CACHE_RESIDENT_BYTES = 1 << 20
"""Above this much intermediate (rows x hidden) on CPU, the direct path never builds the packed
(N, M) matrices: each expert gathers its own rows from x and adds its weighted output to its
tokens, as transformers' eager loop does. At 1024 tokens of E = 64, k = 8 (16 MB packed each way,
page-faulted in anew every forward under the stock allocator) that ran 108.5 ms against 124.3 ms
for gather, experts and ``embedding_bag``, and 122.6 ms for transformers' eager loop."""


@dataclass(frozen=True)
class DirectRows:
    """The T*k choices as packed rows ordered by expert: which choice (flat T*k index) and which
    token each row is."""

    order_N: torch.Tensor
    token_N: torch.Tensor
    rows: FilledRows

    @staticmethod
    def of(expert_idx_TK: torch.Tensor, counts_E: torch.Tensor) -> DirectRows:
        """``counts_E``: the choices of each expert (the router's bincount)."""
        order_N = torch.argsort(expert_idx_TK.flatten(), stable=True)  # stable: each expert's rows in token order
        return DirectRows(order_N, order_N // expert_idx_TK.shape[1], FilledRows.counted(order_N, counts_E))

    def row_of_choice(self) -> torch.Tensor:
        """Where each choice's row landed (flat, T*k): what the weighted sum gathers (the inverse
        of the order, one op)."""
        return torch.argsort(self.order_N)


def direct_experts(
    x_TM: torch.Tensor, expert_idx_TK: torch.Tensor, weights_TK: torch.Tensor, counts_E: torch.Tensor,
    experts: ExpertFFN, backend: str = "torch",
) -> torch.Tensor:
    """y_t = sum over token t's k choices of weight * expert(x_t), with every expert on this rank
    (``experts`` in global expert order, whole; ``counts_E`` the choices per expert), in x's dtype."""
    if x_TM.shape[0] == 0:
        return torch.zeros_like(x_TM)
    weights = experts.weights().cast(x_TM.dtype)
    packed = DirectRows.of(expert_idx_TK, counts_E)
    intermediate_bytes = packed.order_N.numel() * weights.w1.shape[2] * x_TM.element_size()
    if x_TM.device.type == "cpu" and backend == "torch" and intermediate_bytes > CACHE_RESIDENT_BYTES:
        return _expert_by_expert(x_TM, packed, weights_TK, weights, experts.compute.activation)
    x_NM = x_TM.index_select(0, packed.token_N)
    y_NM = packed_ffn_output(x_NM, packed.rows, weights, experts.compute.activation, backend)
    weights_TK = weights_TK if weights_TK.dtype == y_NM.dtype else weights_TK.to(y_NM.dtype)
    return F.embedding_bag(packed.row_of_choice().view_as(expert_idx_TK), y_NM, mode="sum",
                           per_sample_weights=weights_TK)


def _expert_by_expert(
    x_TM: torch.Tensor, packed: DirectRows, weights_TK: torch.Tensor, weights: FFNWeights, activation: Activation
) -> torch.Tensor:
    """Each expert gathers its rows, runs, and adds its weighted rows to their tokens: no (N, M) buffer."""
    weight_N = weights_TK.flatten().index_select(0, packed.order_N).to(x_TM.dtype).unsqueeze(1)
    counts = packed.rows.counts
    y_TM = torch.zeros_like(x_TM)
    per_expert = weights.per_expert()
    for expert, token_R, weight_R in zip(packed.rows.experts, packed.token_N.split(counts), weight_N.split(counts),
                                         strict=True):
        y_RM = expert_rows_ffn(x_TM.index_select(0, token_R), per_expert[expert], activation)
        y_TM.index_add_(0, token_R, y_RM.mul_(weight_R))
    return y_TM


@dataclass(frozen=True)
class LocalDispatcher(DirectDispatcher):
    """Every expert on this rank and nothing to drop: the tokens stay home (:func:`direct_experts`)."""

    experts: ExpertFFN
    labels: DirectLabels

    def experts_output(self, call: LayerCall, routing: Routing, load: GlobalLoad, x_TM: torch.Tensor,
                       timing: PipelineTiming) -> torch.Tensor:
        choice = routing.choice
        return direct_experts(x_TM, choice.expert_idx_TK, choice.weights_TK, routing.counts_E, self.experts,
                              call.kernels.gemm)

