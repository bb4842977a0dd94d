"""Top-k expert selection: logits -> scores -> k experts per token and their combine weights.

Shapes: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertChoice:
    """The k experts a token picked, in descending score order, and how to weight them."""

    expert_idx_TK: torch.Tensor  # int64, choice j of token t
    weights_TK: torch.Tensor  # fp32, differentiable combine weights
    scores_TK: torch.Tensor  # fp32, raw score of each choice
    scores_TE: torch.Tensor  # fp32, all routing scores (for the balance loss)


def routing_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Routing scores from the gate's logits: ``softmax`` over the experts or an element-wise ``sigmoid``."""
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits_TE)
    raise ValueError(f"unknown score_function {score_function!r}; choose softmax or sigmoid")


def group_limited(selection_TE: torch.Tensor, expert_groups: int, top_groups: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the selection scores with every expert outside the
    token's ``top_groups`` best of ``expert_groups`` equal groups set to -inf; a group scores the
    sum of its two best experts (transformers' ``DeepseekV3TopkRouter``)."""
    tokens, experts = selection_TE.shape
    by_group = selection_TE.view(tokens, expert_groups, experts // expert_groups)
    group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = torch.topk(group_scores, top_groups, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return by_group.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, experts)


@dataclass(frozen=True)
class NodeLimit:
    """FasterMoE's topology-aware gate (§4.3) for the tokens of one rank: ``local_E`` marks the
    experts held on this rank's node; at most ``floor(remote_share * T)`` tokens may pick experts
    elsewhere."""

    local_E: torch.Tensor  # bool (E,)
    remote_share: float


def node_limited(selection_TE: torch.Tensor, limit: NodeLimit) -> torch.Tensor:
    """The selection scores under the topology-aware gate. A token whose best expert is on another
    node is "remote". With at most L = floor(share * T) remote tokens nothing changes; with more,
    the L remote tokens whose best score is highest keep their choice, and every other token
    chooses among its node's experts only (the rest set to -inf)."""
    tokens = selection_TE.shape[0]
    allowed = int(limit.remote_share * tokens)
    best_score_T, best_T = selection_TE.max(dim=-1)
    local_E = limit.local_E.to(selection_TE.device)  # built once on the host from the topology
    remote_T = ~local_E[best_T]
    if int(remote_T.sum()) <= allowed:
        return selection_TE
    keeps_T = torch.zeros(tokens, dtype=torch.bool, device=selection_TE.device)
    if allowed:
        keeps_T[best_score_T.masked_fill(~remote_T, float("-inf")).topk(allowed).indices] = True
    restricted_TE = ~keeps_T.unsqueeze(1) & ~local_E.unsqueeze(0)
    return selection_TE.masked_fill(restricted_TE, float("-inf"))


def select_experts(
    logits_TE: torch.Tensor,
    top_k: int,
    score_function: str = "softmax",
    normalize: bool = True,
    expert_bias_E: torch.Tensor | None = None,
    expert_groups: int = 1,
    top_groups: int = 1,
    routed_scaling_factor: float = 1.0,
    node_limit: NodeLimit | None = None,
) -> ExpertChoice:
    """Pick k experts per token.

    ``expert_bias_E`` (auxiliary-loss-free balancing) shifts only which experts are selected; the
    combine weights always come from the unbiased scores. With ``expert_groups`` > 1 a token picks
    only in its ``top_groups`` best groups. With ``normalize`` the k weights of a token sum to one;
    then they are multiplied by ``routed_scaling_factor`` (DeepSeek-V3). ``node_limit`` applies
    FasterMoE's topology-aware gate after the group limit.
    """
    scores_TE = routing_scores(logits_TE, score_function)
    detached_TE = _detached(scores_TE)
    selection_TE = detached_TE if expert_bias_E is None else detached_TE + _detached(expert_bias_E)
    if expert_groups > 1:
        selection_TE = group_limited(selection_TE, expert_groups, top_groups)
    if node_limit is not None:
        selection_TE = node_limited(selection_TE, node_limit)
    expert_idx_TK = torch.topk(selection_TE, top_k, dim=-1).indices
    scores_TK = scores_TE.gather(1, expert_idx_TK)
    weights_TK = scores_TK
    if normalize:
        weights_TK = scores_TK / scores_TK.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights_TK = weights_TK * routed_scaling_factor
    return ExpertChoice(expert_idx_TK, weights_TK, _detached(scores_TK), scores_TE)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` outside the graph; itself where it has none (no op to call: a no-grad forward)."""
    return tensor.detach() if tensor.requires_grad else tensor
