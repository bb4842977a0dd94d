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
    scores_TK: torch.Tensor  # fp32, raw score of each choice (priority of batch-prioritized routing)
    scores_TE: torch.Tensor  # fp32, all routing scores (for the balance loss)


def routing_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits_TE)
    raise ValueError(f"unknown score_function {score_function!r}; choose softmax or sigmoid")


def select_experts(
    logits_TE: torch.Tensor,
    top_k: int,
    score_function: str = "softmax",
    normalize: bool = True,
    expert_bias_E: torch.Tensor | None = None,
) -> ExpertChoice:
    """Pick k experts per token.

    ``expert_bias_E`` (auxiliary-loss-free balancing) shifts only which experts are selected; the
    combine weights always come from the unbiased scores. With ``normalize`` the k weights of a
    token sum to one.
    """
    scores_TE = routing_scores(logits_TE, score_function)
    selection_TE = scores_TE if expert_bias_E is None else scores_TE + expert_bias_E.detach()
    expert_idx_TK = torch.topk(selection_TE.detach(), top_k, dim=-1).indices
    scores_TK = scores_TE.gather(1, expert_idx_TK)
    weights_TK = scores_TK
    if normalize:
        weights_TK = scores_TK / scores_TK.sum(dim=-1, keepdim=True)
    return ExpertChoice(expert_idx_TK, weights_TK, scores_TK.detach(), scores_TE)
