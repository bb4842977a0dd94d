"""Router losses as plain functions (no module state)."""

from __future__ import annotations

import torch

from moeflow.core.routing.slots import expert_counts


def load_balancing_loss(
    scores_TE: torch.Tensor, expert_idx_TK: torch.Tensor, score_function: str = "softmax"
) -> torch.Tensor:
    """Switch-Transformer balance loss E * sum_e f_e * P_e over this rank's tokens.

    f_e is the share of all k*T assignments routed to expert e (before capacity), P_e the mean
    routing probability of e (sigmoid scores are normalized per token first). Equals 1 when
    routing is uniform; 0 for an empty batch.
    """
    num_tokens, num_experts = scores_TE.shape
    if num_tokens == 0:
        return scores_TE.sum() * 0.0
    probs_TE = scores_TE
    if score_function == "sigmoid":
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    counts_E = expert_counts(expert_idx_TK, num_experts)
    fraction_E = counts_E.to(probs_TE.dtype) / expert_idx_TK.numel()
    return num_experts * torch.sum(fraction_E * probs_TE.mean(dim=0))


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean squared log-partition of the logits; keeps logits small."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def updated_expert_bias(
    expert_bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float
) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts and
    lower that of over-loaded ones by ``rate``, from the observed (global) load."""
    load_E = tokens_per_expert_E.to(device=expert_bias_E.device, dtype=expert_bias_E.dtype)
    return expert_bias_E + rate * torch.sign(load_E.mean() - load_E)
