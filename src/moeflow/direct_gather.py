"""The direct gather: a tiny no-grad forward under expert parallelism sends its tokens with its load.

Every forward all-gathers the per-expert counts of every rank before anything else (capacity and
the exchange's splits must agree). At a decode step that collective and the two all-to-alls of the
direct exchange (:mod:`moeflow.direct_exchange`) are three latencies per layer for a few rows each.
Here the counts' all-gather carries the tokens as well: each rank's rows, its k experts and combine
weights, in one fixed-size byte buffer. Every rank then holds every token. It runs its own experts
over the choices that picked them, sums each token's weighted outputs per token (a partial sum over
this rank's experts), and sends each rank the partial sums of its tokens in one all-to-all; each
rank adds the W partial sums of its tokens. Two collectives per layer instead of three, and a token
crosses to each rank once, not once per expert it picked there (DeepEP's deduplication, in the
simplest form).

An all-gather needs one size on every rank, and no rank knows the others' token counts beforehand.
The buffer carries :func:`bucket_after` tokens: the largest rank's count of the layer's
previous gathered forward, which every rank holds alike (a decode step repeats its batch). A rank
with more tokens than the bucket sends only its counts; every rank sees that in the counts and the
forward goes on by the direct exchange or the capacity path, with no further collective for the load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.comm.algorithms import exchange
from moeflow.comm.groups import ParallelGroups
from moeflow.device_copy import to_device
from moeflow.experts import ExpertFFN
from moeflow.ragged import FilledRows, packed_ffn_output
from moeflow.routing.load import GlobalLoad
from moeflow.stats import PipelineTiming

GATHER_TOKENS = 8
"""The most tokens per rank the load all-gather carries (decode batches). Above it, a rank's tokens
would cost every other rank their bytes (an all-gather sends each token to all W ranks)."""

GATHERED = "gathered"
"""The token exchange the statistics name for a forward whose tokens came with the load all-gather."""


@dataclass(frozen=True)
class GatheredTokens:
    """Every rank's tokens of one forward, padded to the bucket: rank s's first ``tokens_W[s]`` rows."""

    tokens_W: list[int]
    x_WBM: torch.Tensor
    expert_idx_WBK: torch.Tensor
    weights_WBK: torch.Tensor

    @property
    def padded(self) -> bool:
        """Some rank had fewer tokens than the bucket: its padding rows (zeros, expert 0) must be
        neither computed nor sent back."""
        return min(self.tokens_W) < self.x_WBM.shape[1]

    def real_WB(self) -> torch.Tensor:
        """Which of the (W, bucket) rows hold a token, on the tokens' device."""
        real = torch.arange(self.x_WBM.shape[1]) < torch.tensor(self.tokens_W).unsqueeze(1)
        return to_device(real, self.x_WBM.device)


@dataclass(frozen=True)
class GatheredLoad:
    """What the all-gather brought: every rank's load, whether every rank asked for a direct path
    (a no-grad forward), and every rank's tokens where all asked and each rank's fit the bucket."""

    load: GlobalLoad
    all_direct: bool
    tokens: GatheredTokens | None


def bucket_after(load: GlobalLoad) -> int:
    """The tokens per rank the layer's next load all-gather carries: this forward's largest rank, if
    at most :data:`GATHER_TOKENS` (the same on every rank: it comes from the gathered counts)."""
    return load.max_tokens_per_rank if load.max_tokens_per_rank <= GATHER_TOKENS else 0


def gather_load(
    x_TM: torch.Tensor, expert_idx_TK: torch.Tensor, weights_TK: torch.Tensor, counts_E: torch.Tensor,
    groups: ParallelGroups, bucket: int, direct: bool,
) -> GatheredLoad:
    """All-gather every rank's counts, whether it asks for a direct path (``direct``: grad mode is
    each rank's own, so the ranks agree on it here), and, where it asks and has at most ``bucket``
    tokens, its tokens (every rank passes the same ``bucket``). One float buffer carries it all: fp64
    when it carries no tokens; otherwise at least fp32, which holds x's dtype without loss and the
    counts and expert indices exactly below 2**24."""
    tokens, k = expert_idx_TK.shape
    experts, model_dim = counts_E.shape[0], x_TM.shape[1]
    sizes = [experts + 2] + ([] if not bucket else [bucket * k, bucket * k, bucket * model_dim])
    dtype = torch.promote_types(x_TM.dtype, torch.float32) if bucket else torch.float64
    local = torch.zeros(sum(sizes), dtype=dtype, device=x_TM.device)
    header, *fields = local.split(sizes)
    header[:experts] = counts_E
    header[experts:] = torch.tensor([tokens, int(direct)], dtype=dtype)
    if direct and 0 < tokens <= bucket:
        for field, values in zip(fields, (expert_idx_TK, weights_TK, x_TM), strict=True):
            field[:values.numel()] = values.flatten()
    every = local.new_empty(groups.size * local.numel())
    with groups.ledger.tracked("load all-gather", groups.expert, local.numel() * local.element_size()):
        dist.all_gather_single(every, local, group=groups.expert)
    header_WE, *fields = every.view(groups.size, -1).split(sizes, dim=1)
    header_WE = header_WE.cpu().long()
    load = GlobalLoad(counts_WE=header_WE[:, :experts].to(counts_E.dtype),
                      max_tokens_per_rank=int(header_WE[:, experts].max()))
    all_direct = bool(header_WE[:, experts + 1].all())
    if not all_direct or not bucket or load.max_tokens_per_rank > bucket:
        return GatheredLoad(load, all_direct, None)
    world = groups.size
    return GatheredLoad(load, all_direct, GatheredTokens(
        header_WE[:, experts].tolist(), fields[2].view(world, bucket, model_dim).to(x_TM.dtype),
        fields[0].view(world, bucket, k).long(), fields[1].view(world, bucket, k)))


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
                                 experts.activation, backend)
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
