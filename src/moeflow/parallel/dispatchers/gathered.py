"""The gathered dispatcher: a tiny no-grad forward under expert parallelism whose tokens came with
the load agreement.

At a decode step the agreement's all-gather and the two all-to-alls of the row exchange
(:mod:`moeflow.parallel.dispatchers.rows`) are three latencies per layer for a few rows each. Here the
agreement's all-gather carries the tokens as well (:mod:`moeflow.parallel.agreement`): each
rank's rows, its k experts and combine weights, in one fixed-size buffer. Every rank then holds
every token. It runs its own experts over the choices that picked them, sums each token's weighted
outputs per token (a partial sum over this rank's experts), and sends each rank the partial sums of
its tokens in one all-to-all; each rank adds the W partial sums of its tokens. Two collectives per
layer instead of three, and a token crosses to each rank once, not once per expert it picked there
(DeepEP's deduplication, in the simplest form).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.comm.algorithms import exchange
from moeflow.comm.groups import ParallelGroups
from moeflow.core.experts import ExpertFFN
from moeflow.core.routing.router import Routing
from moeflow.core.stats import PipelineTiming
from moeflow.kernels.ragged import FilledRows, packed_ffn_output
from moeflow.parallel.agreement import GatheredTokens, GlobalLoad
from moeflow.parallel.dispatchers.protocol import LayerCall
from moeflow.parallel.dispatchers.stats import GATHERED, DirectDispatcher, DirectLabels


@dataclass(frozen=True)
class GatheredDispatcher(DirectDispatcher):
    """Every rank's tokens came with the agreement (:func:`gathered_output`)."""

    tokens: GatheredTokens
    experts: ExpertFFN
    groups: ParallelGroups
    labels: DirectLabels
    exchange = GATHERED

    def experts_output(self, call: LayerCall, routing: Routing, load: GlobalLoad, x_TM: torch.Tensor,
                       timing: PipelineTiming) -> torch.Tensor:
        """Every rank's tokens came with the agreement: ``x_TM`` is this rank's share of them."""
        return gathered_output(self.tokens, load.counts_WE, self.experts, self.groups, call.kernels.gemm, timing)



def gathered_output(
    gathered: GatheredTokens, counts_WE: torch.Tensor, experts: ExpertFFN, groups: ParallelGroups,
    backend: str = "torch", timing: PipelineTiming | None = None,
) -> torch.Tensor:
    """This rank's tokens' outputs (T, M): its experts over every rank's choices that picked them, a
    partial sum per token, and each rank's partial sums sent to it (one all-to-all) and added.
    Expert e is held whole by rank e // L; ``counts_WE`` as the all-gather brought it."""
    timing = PipelineTiming() if timing is None else timing
    start = timing.now()
    world, rank = groups.size, groups.rank
    local = counts_WE.shape[1] // world
    x_WBM = gathered.x_WBM
    bucket, model_dim = x_WBM.shape[1], x_WBM.shape[2]
    # the partial sums in fp32 at least: rounded once, at the end, as the capacity path's combine rounds
    partial_NM = x_WBM.new_zeros((world * bucket, model_dim), dtype=torch.promote_types(x_WBM.dtype, torch.float32))
    counts_L = counts_WE[:, rank * local:(rank + 1) * local].sum(0)
    if int(counts_L.sum()):
        choice_N, token_N, rows = _local_choices(gathered, rank * local, counts_L)
        weights = experts.weights().cast(x_WBM.dtype)
        y_NM = packed_ffn_output(x_WBM.reshape(-1, model_dim).index_select(0, token_N), rows, weights,
                                 experts.compute.activation, backend)
        weight_N = gathered.weights_WBK.flatten().index_select(0, choice_N).to(partial_NM.dtype)
        partial_NM.index_add_(0, token_N, y_NM.to(partial_NM.dtype).mul_(weight_N.unsqueeze(1)))
    timing.expert_forward_s = timing.now() - start
    tokens_W = gathered.tokens_W
    if gathered.padded:  # only each rank's real rows go back to it
        partial_NM = partial_NM.view(world, bucket, model_dim)[gathered.real_WB()]
    matrix = [list(tokens_W) for _ in range(world)]  # every rank sends rank d its tokens_W[d] rows
    received_NM = exchange("linear", partial_NM, groups, matrix)
    timing.forward_s = timing.now() - start
    return received_NM.view(world, tokens_W[rank], model_dim).sum(0).to(x_WBM.dtype)


def _local_choices(
    gathered: GatheredTokens, first_expert: int, counts_L: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, FilledRows]:
    """The gathered choices of this rank's experts, ordered by expert: their flat (s, b, j) index,
    their flat (s, b) token row, and the packed rows' layout."""
    expert_WBK = gathered.expert_idx_WBK
    k = expert_WBK.shape[2]
    local_WBK = (expert_WBK >= first_expert) & (expert_WBK < first_expert + counts_L.numel())
    if gathered.padded:  # a padding row's zeros would pick expert 0
        local_WBK &= gathered.real_WB().unsqueeze(2)
    choice_N = local_WBK.flatten().nonzero().squeeze(1)
    order_N = torch.argsort(expert_WBK.flatten().index_select(0, choice_N), stable=True)
    choice_N = choice_N.index_select(0, order_N)
    return choice_N, choice_N // k, FilledRows.counted(order_N, counts_L)
