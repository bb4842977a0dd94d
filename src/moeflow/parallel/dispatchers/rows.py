"""The row-exchange dispatcher: a small no-grad forward under expert parallelism, with no capacity buffer.

A decode step routes a handful of tokens (batch x k rows per rank), yet the capacity path builds
an (E, C, M) buffer, plans a pipeline, exchanges every slot (or gathers the kept ones out of the
buffer and scatters them back on both sides of each all-to-all) and decodes through the buffer:
a few hundred small ops around two all-to-alls of a few rows. Here the k choices of every token
are sorted by expert once, which under the expert-parallel placement (rank d holds experts
[d L, (d + 1) L)) also orders them by destination rank. The rows go out in one ragged
all-to-all: the splits come from the load all-gather every forward runs anyway (the per-expert
counts of every rank), so no split exchange is added. Each rank runs its experts over what it
received, sends the outputs back over the transposed splits, and every token sums its k rows with
its combine weights in one ``embedding_bag``, as :mod:`moeflow.parallel.dispatchers.local` does on one rank.

It runs where the capacity path would keep every token (capacity >= the busiest expert's count
on every rank) and the largest rank routes at most :data:`DIRECT_EXCHANGE_ROWS` rows, and its
tokens did not come with the load agreement (:mod:`moeflow.parallel.dispatchers.gathered`); the decision is
:func:`moeflow.parallel.dispatchers.choice.agree`'s, from the load every rank holds alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeflow.comm.algorithms import exchange, transpose
from moeflow.comm.groups import ParallelGroups
from moeflow.config import RAGGED
from moeflow.core.device_copy import to_device
from moeflow.core.experts import ExpertFFN
from moeflow.core.routing.router import Routing
from moeflow.core.stats import PipelineTiming
from moeflow.kernels.ragged import FilledRows, packed_ffn_output
from moeflow.parallel.agreement import GlobalLoad
from moeflow.parallel.dispatchers.local import DirectRows
from moeflow.parallel.dispatchers.protocol import LayerCall
from moeflow.parallel.dispatchers.stats import DirectDispatcher, DirectLabels

DIRECT_EXCHANGE_ROWS = 256
"""The most rows (tokens x k) one rank may route for a no-grad forward to take the direct exchange:
decode batches up to 32 sequences per rank at k = 8. Over loopback on 2 ranks (E = 64, k = 8,
M = 512, swiglu) the direct exchange ran faster than the capacity path at every size measured, up
to 2048 rows (6.1 against 7.3 ms at 8 rows, 19.0 against 22.5 at 256, 49.1 against 59.9 at 2048);
on a slow link the capacity path's pipeline may hide part of a large exchange, which the direct
exchange does not, so the bound stays at the sizes measured on the emulated cluster."""


@dataclass(frozen=True)
class RowDispatcher(DirectDispatcher):
    """Only the routed rows travel, one ragged all-to-all each way (:func:`exchanged_experts`)."""

    experts: ExpertFFN
    groups: ParallelGroups
    labels: DirectLabels

    exchange = RAGGED

    def experts_output(self, call: LayerCall, routing: Routing, load: GlobalLoad, x_TM: torch.Tensor,
                       timing: PipelineTiming) -> torch.Tensor:
        choice = routing.choice
        return exchanged_experts(x_TM, choice.expert_idx_TK, choice.weights_TK, load.counts_WE, self.experts,
                                 self.groups, call.kernels.gemm, timing)



def exchanged_experts(
    x_TM: torch.Tensor, expert_idx_TK: torch.Tensor, weights_TK: torch.Tensor, counts_WE: torch.Tensor,
    experts: ExpertFFN, groups: ParallelGroups, backend: str = "torch", timing: PipelineTiming | None = None,
) -> torch.Tensor:
    """y_t = sum over token t's k choices of weight * expert(x_t), expert e held whole by rank
    e // L of ``groups.expert`` (``experts``: this rank's L). ``counts_WE[s, e]``: the choices rank
    s routes to expert e (host, the same on every rank). ``timing``: the exchange-to-exchange region
    (``forward_s``) and its experts (``expert_forward_s``), as the pipeline reports them."""
    timing = PipelineTiming() if timing is None else timing
    start = timing.now()
    world, rank = groups.size, groups.rank
    local = counts_WE.shape[1] // world
    packed = DirectRows.of(expert_idx_TK, counts_WE[rank])
    matrix = counts_WE.view(world, world, local).sum(2).tolist()  # matrix[s][d]: rows s sends d
    received_RM = exchange("linear", x_TM.index_select(0, packed.token_N), groups, matrix)
    experts_start = timing.now()
    y_RM = _local_experts(received_RM, counts_WE[:, rank * local:(rank + 1) * local], experts, backend)
    timing.expert_forward_s = timing.now() - experts_start
    returned_NM = exchange("linear", y_RM, groups, transpose(matrix))
    timing.forward_s = timing.now() - start
    return F.embedding_bag(packed.row_of_choice().view_as(expert_idx_TK), returned_NM, mode="sum",
                           per_sample_weights=weights_TK.to(returned_NM.dtype))


def _local_experts(
    received_RM: torch.Tensor, counts_WL: torch.Tensor, experts: ExpertFFN, backend: str
) -> torch.Tensor:
    """This rank's experts over the rows it received (by source rank, then local expert), the
    outputs in the received order: the rows are regrouped expert-major for the kernel and back."""
    local = counts_WL.shape[1]
    if received_RM.shape[0] == 0:
        return received_RM  # nothing to compute: an empty (0, M) output
    expert_R = torch.arange(local).repeat(counts_WL.shape[0]).repeat_interleave(counts_WL.flatten())
    order_R = torch.argsort(expert_R, stable=True)  # stable: each expert's rows by source rank
    rows = FilledRows.counted(order_R, counts_WL.sum(0))
    order_R = to_device(order_R, received_RM.device)
    weights = experts.weights().cast(received_RM.dtype)
    y_RM = packed_ffn_output(received_RM.index_select(0, order_R), rows, weights, experts.compute.activation, backend)
    return torch.empty_like(y_RM).index_copy_(0, order_R, y_RM)
