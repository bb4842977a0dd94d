"""MoELayer's public API: bad input, statistics, dynamic settings, state-dict names."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEConfig, MoELayer


def make(**overrides) -> MoELayer:
    kwargs = {"model_dim": 8, "hidden_dim": 12, "num_experts": 4, **overrides}
    return MoELayer(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"top_k": 5}, "top_k=5 is larger than num_experts=4"),
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"gate": "linear"}, "unknown gate 'linear'"),
        ({"activation": "tanh"}, "unknown activation 'tanh'"),
        ({"score_function": "relu"}, "unknown score_function"),
        ({"model_dim": 0}, "model_dim must be a positive integer"),
        ({"num_experts": 2.5}, "num_experts must be a positive integer"),
        ({"capacity_factor": float("nan")}, "capacity_factor must be finite"),
        ({"aux_loss_weight": -1.0}, "aux_loss_weight must be a finite number >= 0"),
        ({"num_shared_experts": -1}, "num_shared_experts"),
        ({"expert_kernel": "fastest"}, "unknown expert_kernel"),
        ({"alltoall": "ring"}, "unknown alltoall 'ring'"),
        ({"expert_groups": 3}, "cannot form expert_groups=3 equal groups"),
        ({"expert_groups": 4}, "equal groups of at least 2"),
        ({"top_groups": 2}, "top_groups=2 needs expert_groups > 1"),
        ({"expert_groups": 2, "top_groups": 1, "top_k": 3}, "hold 2 experts, fewer than top_k=3"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be a finite number > 0"),
        ({"shared_expert_gate": True}, "set num_shared_experts >= 1"),
        ({"num_shared_experts": 1, "shared_hidden_dim": 0}, "shared_hidden_dim must be a positive integer"),
        ({"swiglu_limit": 7.0}, "swiglu_limit clamps SwiGLU experts; activation='gelu'"),
        ({"activation": "swiglu", "swiglu_limit": 0.0}, "swiglu_limit must be > 0"),
        ({"activation": "swiglu", "swiglu_limit": float("inf")}, "swiglu_limit must be a finite number"),
        ({"activation": "swiglu", "swiglu_alpha": 1.702}, "set swiglu_limit too"),
        ({"activation": "swiglu", "swiglu_clamp_shared": True}, "swiglu_clamp_shared=True clamps the shared"),
        ({"gate_bias": True, "gate": "cosine"}, "gate_bias=True adds a bias to the linear gate's logits"),
        ({"gate_precision": "fp16"}, "unknown gate_precision"),
        ({"gate_precision": "input", "gate": "cosine"}, "gate_precision='input' applies to the linear gate"),
        ({"expert_kernel": "ragged", "parallel": "adaptive"}, "expert_kernel='ragged' runs with parallel in"),
    ],
)
def test_bad_arguments_name_themselves(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_bad_inputs_are_rejected_with_the_fix() -> None:
    layer = make()
    with pytest.raises(ValueError, match="last dimension must be model_dim=8"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="floating-point"):
        layer(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"layer.to\(torch.float64\)"):
        layer(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="top_k=9 is larger than num_experts=4"):
        layer(torch.randn(3, 8), top_k=9)
    nan_input = torch.randn(3, 8)
    nan_input[1, 2] = float("nan")
    layer(nan_input)  # unchecked by default
    with pytest.raises(ValueError, match="NaN or inf"):
        make(check_finite=True)(nan_input)
    inf_input = torch.randn(3, 8)
    inf_input[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        make(check_finite=True)(inf_input)


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown MoE config key\(s\) \['topk'\]"):
        MoEConfig.from_dict({"model_dim": 8, "hidden_dim": 8, "num_experts": 2, "topk": 1})
    config = MoEConfig(model_dim=8, hidden_dim=8, num_experts=2)
    assert MoEConfig.from_dict(config.to_dict()) == config


def test_stats_count_drops_and_capacity() -> None:
    torch.manual_seed(0)
    layer = make(capacity_factor=0.5, top_k=2)
    layer(torch.randn(40, 8))
    stats = layer.last_stats
    assert stats is not None
    assert stats.capacity == 10  # ceil(2 * 0.5 * 40 / 4)
    assert sum(stats.tokens_per_expert) == 80
    assert stats.dropped == sum(max(0, n - 10) for n in stats.tokens_per_expert) > 0
    assert stats.plan is not None and stats.plan.world_size == 1 and stats.plan.pipeline_degree == 1
    layer(torch.randn(40, 8), capacity_factor=0)
    assert layer.last_stats.dropped == 0
    assert layer.last_stats.capacity == max(layer.last_stats.tokens_per_expert)
    assert layer.last_stats.to_dict()["effective_capacity_factor"] >= 1.0


def test_dynamic_top_k_and_shapes() -> None:
    layer = make(top_k=2)
    x = torch.randn(2, 5, 8)
    assert layer(x).shape == x.shape
    layer(x, top_k=1)
    assert layer.last_stats.top_k == 1 and sum(layer.last_stats.tokens_per_expert) == 10
    layer(x, top_k=4)
    assert sum(layer.last_stats.tokens_per_expert) == 40


def test_aux_loss_is_in_the_graph() -> None:
    layer = make(aux_loss_weight=1.0, z_loss_weight=0.1)
    layer(torch.randn(16, 8))
    assert layer.aux_loss.requires_grad and layer.aux_loss.dim() == 0
    layer.aux_loss.backward()
    assert layer.gate.weight.grad.abs().sum() > 0


def test_bias_balancing_moves_load_toward_balance() -> None:
    torch.manual_seed(0)
    layer = make(num_experts=4, top_k=1, expert_bias_update_rate=0.02, aux_loss_weight=0.0)
    with torch.no_grad():
        layer.gate.weight[0] += 0.5  # expert 0 popular
    x = torch.randn(256, 8)
    layer(x)
    first = layer.last_stats.tokens_per_expert
    for _ in range(60):
        layer(x)
    last = layer.last_stats.tokens_per_expert
    assert max(last) - min(last) < max(first) - min(first)
    bias_before = layer.gate.expert_bias.clone()
    layer.eval()
    layer(x)
    torch.testing.assert_close(layer.gate.expert_bias, bias_before)  # eval never updates


def test_a_swiglu_state_saved_before_the_up_bias_loads_with_it_zero() -> None:
    layer = make(activation="swiglu", num_shared_experts=1)
    old = {name: t for name, t in layer.full_state_dict().items() if not name.endswith(".b3")}
    with torch.no_grad():
        layer.experts.b3.fill_(1.0)
        layer.shared_experts.b3.fill_(1.0)
    layer.load_full_state_dict(old)
    assert not layer.experts.b3.any() and not layer.shared_experts.b3.any()


def test_state_dict_names_are_fixed() -> None:
    names = set(make(activation="swiglu", num_shared_experts=1).state_dict())
    assert names == {
        "gate.weight", "gate.expert_bias", "experts.w1", "experts.b1", "experts.w2", "experts.b2",
        "experts.w3", "experts.b3", "shared_experts.w1", "shared_experts.b1", "shared_experts.w2",
        "shared_experts.b2", "shared_experts.w3", "shared_experts.b3",
    }
    cosine = make(gate="cosine", cosine_projection_dim=6).state_dict()
    assert cosine["gate.projection"].shape == (6, 8)
    assert cosine["gate.weight"].shape == (4, 6)
    assert cosine["gate.logit_scale"].shape == (1,)
    assert make().state_dict()["experts.w1"].shape == (4, 8, 12)


def test_group_limited_routing_picks_only_in_the_best_groups() -> None:
    """DeepSeek-V3: a group scores the sum of its two best experts; a token's k experts come from
    its top_groups best groups, and the combine weights are scaled after normalising."""
    from moeflow.core.routing import select_experts

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=generator)
    choice = select_experts(logits, 4, "sigmoid", True, None, expert_groups=4, top_groups=2, routed_scaling_factor=2.5)
    scores = torch.sigmoid(logits)
    best_groups = scores.view(64, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for token in range(64):
        allowed = {int(g) * 4 + e for g in best_groups[token] for e in range(4)}
        picked = set(choice.expert_idx_TK[token].tolist())
        assert picked <= allowed
        best_allowed = sorted(allowed, key=lambda e: -float(scores[token, e]))[:4]
        assert picked == set(best_allowed)
    assert torch.allclose(choice.weights_TK.sum(-1), torch.full((64,), 2.5))
    with pytest.raises(ValueError, match="fewer than top_k=5"):
        make(num_experts=8, expert_groups=4, top_groups=2, top_k=4)(torch.randn(3, 8), top_k=5)


def test_tutel_arguments_only_forward_to_the_config() -> None:
    import inspect

    from moeflow.config import MoEConfig

    parameters = inspect.signature(MoELayer.__init__).parameters
    assert list(parameters) == ["self", "config", "args", "group", "profile", "mp_group", "settings"]  # no setting
    assert MoELayer(8, 16, 4).config == MoEConfig(8, 16, 4)  # MoEConfig's defaults are the only ones
    tutel_order = MoELayer(8, 16, 4, 1, 1.5, "cosine", "relu", False, True, 0.1, 0.2, None).config
    assert tutel_order == MoEConfig(
        model_dim=8, hidden_dim=16, num_experts=4, top_k=1, capacity_factor=1.5, gate="cosine", activation="relu",
        normalize_gate=False, batch_prioritized_routing=True, aux_loss_weight=0.1, z_loss_weight=0.2,
    )
    settings = dict(parallel="replicated", shadowing="off", bias=False, activation="swiglu", num_shared_experts=1)
    config = MoEConfig(8, 16, 4, **settings)
    by_keyword, by_config = MoELayer(8, 16, 4, **settings), MoELayer(config)
    assert by_keyword.config == config == by_config.config
    assert list(by_keyword.state_dict()) == list(by_config.state_dict())
    with pytest.raises(TypeError, match="unexpected setting 'paralel'; did you mean 'parallel'"):
        MoELayer(8, 16, 4, paralel="expert")
    with pytest.raises(TypeError, match="not both"):
        MoELayer(config, top_k=1)
    with pytest.raises(TypeError, match="top_k both by position and by keyword"):
        MoELayer(8, 16, 4, 2, top_k=1)
