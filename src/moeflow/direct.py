"""The direct path: a forward on a rank that holds every expert, with no capacity buffer.

Where a forward needs no other rank and runs no backward (generation or evaluation on one
process), the capacity layout is only overhead. Encode scatters the tokens into an (E, C, M)
buffer, the ragged kernel gathers the filled slots out of it and scatters its output back, and
decode gathers once more, while the load exchange and the planner plan a pipeline of one chunk.
Here the k choices of every token are sorted by expert once and their rows gathered straight from
x. The experts run over their rows (:func:`moeflow.ragged.packed_ffn_output`, which never reads an
empty expert's weights), and each token sums its k rows with its combine weights in one
``embedding_bag``, as decode does. It computes the same function as the capacity path wherever that
path drops nothing (:func:`moeflow.capacity.never_drops`), with the ragged kernel's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeflow.capacity import expert_capacity
from moeflow.experts import ExpertFFN
from moeflow.ragged import FilledRows, packed_ffn_output
from moeflow.stats import ExecutionPlan, RoutingStats

SOURCE = "direct"
"""The plan source the statistics name for a forward that took the direct path."""


@dataclass(frozen=True)
class DirectRows:
    """The T*k choices as packed rows ordered by expert: each row's token, and where each choice's
    row landed (``row_TK``, what the weighted sum gathers)."""

    token_N: torch.Tensor
    row_TK: torch.Tensor
    rows: FilledRows

    @staticmethod
    def of(expert_idx_TK: torch.Tensor, counts_E: torch.Tensor) -> DirectRows:
        """``counts_E``: the choices of each expert (the router's bincount)."""
        order_N = torch.argsort(expert_idx_TK.flatten(), stable=True)  # stable: each expert's rows in token order
        row_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
        return DirectRows(order_N // expert_idx_TK.shape[1], row_N.view_as(expert_idx_TK),
                          FilledRows.counted(order_N, counts_E))


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
    x_NM = x_TM.index_select(0, packed.token_N)
    y_NM = packed_ffn_output(x_NM, packed.rows, weights, experts.activation, backend)
    return F.embedding_bag(packed.row_TK, y_NM, mode="sum", per_sample_weights=weights_TK.to(y_NM.dtype))


def direct_stats(
    counts_E: torch.Tensor, top_k: int, capacity_factor: float, schedule: str, policy: int | str,
) -> RoutingStats:
    """What a direct forward reports (on first read of ``MoELayer.last_stats``): its own counts,
    nothing dropped, one local "chunk" with no all-to-all."""
    tokens_per_expert = counts_E.tolist()
    num_tokens = sum(tokens_per_expert) // top_k
    capacity = expert_capacity(capacity_factor, top_k, num_tokens, len(tokens_per_expert), max(tokens_per_expert))
    plan = ExecutionPlan(schedule=schedule, alltoall="none", pipeline_degree=1, requested_degree=1, policy=policy,
                         source=SOURCE, world_size=1, expert_kernel="ragged", slots=capacity,
                         token_exchange="none")
    return RoutingStats(num_tokens=num_tokens, top_k=top_k, capacity=capacity, capacity_factor=capacity_factor,
                        tokens_per_expert=tokens_per_expert, dropped_per_expert=[0] * len(tokens_per_expert),
                        plan=plan, rank_tokens=(sum(tokens_per_expert),), cross_node_rows=0)
