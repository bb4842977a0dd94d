"""Routing pieces against brute-force definitions."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow.core.routing import (
    CosineGate,
    assign_slots,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
    select_experts,
    updated_expert_bias,
)


def brute_force_slots(
    expert_idx: list[list[int]], priority: list[float] | None, token_major: bool = False
) -> list[list[int]]:
    tokens, k = len(expert_idx), len(expert_idx[0]) if expert_idx else 0
    filled: dict[int, int] = {}
    location = [[-1] * k for _ in range(tokens)]
    order = sorted(range(tokens), key=lambda t: -priority[t]) if priority else range(tokens)
    fill = [(t, j) for t in order for j in range(k)] if token_major else [(t, j) for j in range(k) for t in order]
    for t, j in fill:
        e = expert_idx[t][j]
        location[t][j] = filled.get(e, 0)
        filled[e] = filled.get(e, 0) + 1
    return location


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 1, 1), (17, 4, 2), (64, 8, 3), (50, 3, 3)])
def test_slots_follow_choice_rank_then_token_order(tokens: int, experts: int, k: int, prioritized: bool) -> None:
    generator = torch.Generator().manual_seed(tokens * 31 + k)
    expert_idx = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    priority = torch.rand(tokens, generator=generator).round(decimals=1) if prioritized else None  # ties
    location, counts = assign_slots(expert_idx, experts, priority)
    expected = brute_force_slots(expert_idx.tolist(), priority.tolist() if priority is not None else None)
    assert location.tolist() == expected
    assert counts.tolist() == torch.bincount(expert_idx.flatten(), minlength=experts).tolist()
    # a dropless call's order: each token's choices together
    location, counts = assign_slots(expert_idx, experts, priority, token_major=True)
    expected = brute_force_slots(expert_idx.tolist(), priority.tolist() if priority is not None else None, True)
    assert location.tolist() == expected
    assert counts.tolist() == torch.bincount(expert_idx.flatten(), minlength=experts).tolist()


def tutel_locations(scores_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tutel's published rule (``extract_critical`` with ``batch_prioritized_routing=True``): the
    one-hot choices of each choice rank, numbered by a cumulative sum over the tokens sorted by their
    highest score, each rank after the earlier ranks' counts."""
    experts = scores_TE.shape[1]
    chosen_TK = torch.topk(scores_TE, top_k, dim=1).indices
    order = torch.argsort(-scores_TE.max(dim=1).values, stable=True)
    base_E = torch.zeros(experts, dtype=torch.int64)
    locations = []
    for j in range(top_k):
        mask_TE = torch.nn.functional.one_hot(chosen_TK[:, j], experts)
        sorted_mask = mask_TE[order]
        numbered = ((torch.cumsum(sorted_mask, 0) - 1) * sorted_mask)[order.argsort()] + base_E
        locations.append((numbered * mask_TE).sum(1))
        base_E = base_E + mask_TE.sum(0)
    return torch.stack(locations, 1)


def test_batch_prioritized_slots_follow_tutels_rule() -> None:
    """At k = 2 a token's second choice keeps the place its highest score earned: here token 0
    (best score 0.6) takes expert 2's first slot though token 1 scored expert 2 higher (0.4 > 0.3)."""
    from moeflow.config import MoEConfig
    from moeflow.core.routing.router import route

    scores = torch.tensor([[0.6, 0.1, 0.3], [0.05, 0.55, 0.4]])

    def routed(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
        config = MoEConfig(model_dim=scores_TE.shape[1], hidden_dim=4, num_experts=scores_TE.shape[1], top_k=k,
                           batch_prioritized_routing=True, normalize_gate=False)
        gate = torch.nn.Identity()
        gate.expert_bias = torch.zeros(scores_TE.shape[1])  # type: ignore[assignment]
        return route(gate, scores_TE.log(), k, config).location_TK  # the gate passes log p: softmax gives p

    assert routed(scores, 2).tolist() == tutel_locations(scores, 2).tolist() == [[0, 0], [0, 1]]
    generator = torch.Generator().manual_seed(3)
    for tokens, experts, k in [(64, 8, 2), (50, 4, 3), (33, 6, 2)]:
        random_scores = torch.softmax(torch.randn(tokens, experts, generator=generator) * 2, dim=1)
        assert torch.equal(routed(random_scores, k), tutel_locations(random_scores, k))


def test_slots_of_empty_batch() -> None:
    location, counts = assign_slots(torch.empty(0, 2, dtype=torch.int64), 4)
    assert location.shape == (0, 2)
    assert counts.tolist() == [0, 0, 0, 0]


def test_capacity_rules_of_tutel() -> None:
    assert expert_capacity(1.0, 2, 4096, 8, needed=5000) == 1024
    assert expert_capacity(1.25, 1, 10, 4, needed=0) == math.ceil(1.25 * 10 / 4)
    assert expert_capacity(0.0, 2, 100, 8, needed=37) == 37
    assert expert_capacity(-1.5, 2, 100, 8, needed=20) == 20  # under the cap
    assert expert_capacity(-1.5, 2, 100, 8, needed=90) == math.ceil(1.5 * 2 * 100 / 8)  # capped
    assert expert_capacity(1.0, 2, 0, 8, needed=0) == 0


def test_selection_normalizes_and_bias_only_moves_the_choice() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain = select_experts(logits, 2)
    assert plain.expert_idx_TK.tolist() == [[0, 1]]
    torch.testing.assert_close(plain.weights_TK.sum(-1), torch.ones(1))
    biased = select_experts(logits, 2, expert_bias_E=torch.tensor([0.0, 0.0, 5.0, 0.0]))
    assert biased.expert_idx_TK.tolist() == [[2, 0]]
    probs = torch.softmax(logits, -1)[0]
    expected = torch.stack([probs[2], probs[0]]) / (probs[2] + probs[0])
    torch.testing.assert_close(biased.weights_TK[0], expected)


def test_sigmoid_scores_without_normalization_are_raw_sigmoids() -> None:
    logits = torch.randn(5, 6)
    choice = select_experts(logits, 3, "sigmoid", normalize=False)
    torch.testing.assert_close(choice.weights_TK, torch.sigmoid(logits).gather(1, choice.expert_idx_TK))


def test_balance_loss_is_one_for_uniform_routing_and_larger_when_skewed() -> None:
    uniform = torch.full((8, 4), 0.25)
    round_robin = torch.arange(8).remainder(4).unsqueeze(1)
    assert load_balancing_loss(uniform, round_robin).item() == pytest.approx(1.0)
    skewed_scores = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(8, 4)
    assert load_balancing_loss(skewed_scores, torch.zeros(8, 1, dtype=torch.int64)).item() == pytest.approx(2.8)
    assert load_balancing_loss(torch.empty(0, 4), torch.empty(0, 1, dtype=torch.int64)).item() == 0.0


def test_z_loss_and_bias_update() -> None:
    logits = torch.zeros(3, 4)
    assert router_z_loss(logits).item() == pytest.approx(math.log(4) ** 2)
    bias = updated_expert_bias(torch.zeros(3), torch.tensor([10, 5, 0]), rate=0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.0, 0.1]))


def test_cosine_gate_is_scale_invariant_and_clamps_temperature() -> None:
    gate = CosineGate(model_dim=8, num_experts=4, projection_dim=6, min_temperature=0.05)
    x = torch.randn(5, 8)
    torch.testing.assert_close(gate(x), gate(10 * x))
    with torch.no_grad():
        gate.logit_scale.fill_(100.0)
    assert gate(x).abs().max().item() <= 1 / 0.05 + 1e-4
