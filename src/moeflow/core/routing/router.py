"""The router of one layer call: gate -> selection -> losses -> slots, as one frozen result.

The gate module (its parameters and DeepSeek-V3's ``expert_bias`` buffer) stays the layer's, under
its state-dict names; everything else here is a function of it, the layer's settings and x.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moeflow.config import MoEConfig
from moeflow.core.routing.losses import load_balancing_loss, router_z_loss, updated_expert_bias
from moeflow.core.routing.selection import ExpertChoice, NodeLimit, select_experts
from moeflow.core.routing.slots import assign_slots, expert_counts


@dataclass(frozen=True)
class Routing:
    """This rank's routed tokens: the choice (weights, experts, scores), the weighted balance
    (+ z) loss in the graph, each choice's slot in its expert and the assignments per expert."""

    choice: ExpertChoice
    aux_loss: torch.Tensor
    location_TK: torch.Tensor | None  # None: slots not assigned (the direct path)
    counts_E: torch.Tensor
    priority_T: torch.Tensor | None = None  # batch-prioritized routing's order key (None: token order)
    token_major: bool = False  # a dropless call's slots: a token's choices filled together

    def slotted(self, num_experts: int) -> Routing:
        """This routing with its capacity slots assigned (those of ``route(..., slots=False)`` now)."""
        if self.location_TK is not None:
            return self
        location_TK, _ = assign_slots(self.choice.expert_idx_TK, num_experts, self.priority_T, self.token_major)
        return dataclasses.replace(self, location_TK=location_TK)


def route(
    gate: nn.Module, x_TM: torch.Tensor, top_k: int, config: MoEConfig, node_limit: NodeLimit | None = None,
    observe: Callable[[ExpertChoice], ExpertChoice] | None = None, slots: bool = True, dropless: bool = False,
) -> Routing:
    """Route ``x_TM`` to ``top_k`` experts each; ``observe`` sees (and may replace) the choice
    before slots are assigned (an inference scheduler). ``slots=False`` leaves the capacity slots
    unassigned (``location_TK`` None): for a forward with no capacity buffer. ``dropless``: the
    call drops nothing (capacity factor 0), so a token's choices fill their slots together
    (:func:`~moeflow.core.routing.slots.assign_slots`)."""
    normalize = config.normalize_gate if config.normalize_gate is not None else top_k > 1
    logits_TE = gate(x_TM)
    choice = select_experts(
        logits_TE, top_k, config.score_function, normalize, gate.expert_bias,  # zeros unless set or updated
        config.expert_groups, config.top_groups, config.routed_scaling_factor, checked_node_limit(node_limit, top_k),
    )
    if observe is not None:
        choice = observe(choice)
    priority_T = choice.scores_TE.detach().max(dim=1).values if config.batch_prioritized_routing else None  # Tutel's
    if slots:
        location_TK, counts_E = assign_slots(choice.expert_idx_TK, config.num_experts, priority_T, dropless)
    else:
        location_TK, counts_E = None, expert_counts(choice.expert_idx_TK, config.num_experts)
    return Routing(choice, router_loss(config, logits_TE, choice), location_TK, counts_E, priority_T, dropless)


def router_loss(config: MoEConfig, logits_TE: torch.Tensor, choice: ExpertChoice) -> torch.Tensor:
    """The weighted balance loss plus the weighted z-loss (each only when its weight is > 0)."""
    loss = logits_TE.new_zeros(())
    if config.aux_loss_weight > 0:
        balance = load_balancing_loss(choice.scores_TE, choice.expert_idx_TK, config.score_function)
        loss = loss + config.aux_loss_weight * balance
    if config.z_loss_weight > 0:
        loss = loss + config.z_loss_weight * router_z_loss(logits_TE)
    return loss


def checked_node_limit(limit: NodeLimit | None, top_k: int) -> NodeLimit | None:
    """The topology-aware gate, if a node holds at least ``top_k`` experts for its tokens to pick."""
    if limit is not None and int(limit.local_E.sum()) < top_k:
        raise ValueError(
            f"topology_gate: a node holds {int(limit.local_E.sum())} experts, fewer than top_k={top_k}, so its "
            "tokens cannot all choose within it; use more experts per node, a smaller top_k or topology_gate='off'"
        )
    return limit


@torch.no_grad()
def update_expert_bias(gate: nn.Module, load_E: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): shift the selection bias from the global load."""
    gate.expert_bias.copy_(updated_expert_bias(gate.expert_bias, load_E, rate))
