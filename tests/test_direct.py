"""The direct path (moeflow.direct): a no-grad forward on one rank with every expert skips the
capacity buffer, computes what the capacity path and the reference compute, and is taken only
where it may be."""

from __future__ import annotations

import collections
import inspect
from typing import Any

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.capacity import never_drops
from moeflow.parallel.dispatchers.local import CACHE_RESIDENT_BYTES
from moeflow.parallel.dispatchers.stats import SOURCE
from moeflow.reference import ReferenceMoE
from op_count import OpCount

M, H, E = 16, 24, 8


def _pair(**settings: Any) -> tuple[MoELayer, ReferenceMoE]:
    """The layer and its reference; a call with grad runs the capacity path (``expert_kernel="bmm"``:
    under ``auto`` the probe's timings may send it to the kept-rows path, which reports ``direct``)."""
    torch.manual_seed(0)
    settings = {"expert_kernel": "bmm", **settings}
    reference_settings = {k: v for k, v in settings.items() if k in inspect.signature(ReferenceMoE).parameters}
    reference = ReferenceMoE(M, H, E, **reference_settings)
    layer = MoELayer(M, H, E, **settings)
    layer.load_full_state_dict(reference.state_dict())
    return layer, reference


CASES = [
    {"top_k": 2, "capacity_factor": 0.0},
    {"top_k": 1, "capacity_factor": 0.0, "activation": "relu"},
    {"top_k": 3, "capacity_factor": 0.0, "activation": "swiglu", "bias": False, "num_shared_experts": 1},
    {"top_k": 2, "capacity_factor": 0.0, "score_function": "sigmoid", "expert_groups": 4, "top_groups": 2,
     "routed_scaling_factor": 2.5},
    {"top_k": 2, "capacity_factor": 4.0},  # C = ceil(2 * 4 * T / 8) = T: cannot drop
]


@pytest.mark.parametrize("settings", CASES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_direct_forward_equals_the_capacity_path_and_the_reference(settings: dict, tokens: int) -> None:
    layer, reference = _pair(**settings)
    x = torch.randn(tokens, M, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        direct = layer(x)
        assert layer.last_stats.plan.source == SOURCE
        expected = reference(x)
    capacity_path = layer(x)  # grad enabled: the capacity path
    assert layer.last_stats.plan.source != SOURCE
    torch.testing.assert_close(direct, capacity_path.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(direct, expected, rtol=1e-5, atol=1e-6)


def test_direct_forward_in_bf16_matches_the_capacity_path() -> None:
    layer, _ = _pair(top_k=2, capacity_factor=0.0, activation="swiglu", bias=False)
    x = torch.randn(6, M).bfloat16()
    with torch.no_grad():
        direct = layer(x)
        assert layer.last_stats.plan.source == SOURCE and direct.dtype == torch.bfloat16
    torch.testing.assert_close(direct, layer(x).detach(), rtol=2e-2, atol=2e-2)


def test_direct_stats_count_every_choice_and_drop_nothing() -> None:
    layer, _ = _pair(top_k=2, capacity_factor=0.0)
    with torch.no_grad():
        layer(torch.randn(3, 5, M))
    stats = layer.last_stats
    assert stats.num_tokens == 15 and sum(stats.tokens_per_expert) == 30 and stats.dropped == 0
    assert stats.capacity == max(stats.tokens_per_expert) and stats.plan.world_size == 1
    assert stats.plan.alltoall == "none" and stats.plan.pipeline_degree == 1


def test_a_capacity_that_can_drop_keeps_the_capacity_path() -> None:
    layer, reference = _pair(top_k=2, capacity_factor=0.5)
    x = torch.randn(40, M)
    assert not never_drops(0.5, 2, 40, E) and never_drops(0.0, 2, 40, E) and never_drops(-4.0, 2, 40, E)
    with torch.no_grad():
        y = layer(x)
        assert layer.last_stats.plan.source != SOURCE and layer.last_stats.dropped > 0
        torch.testing.assert_close(y, reference(x), rtol=1e-5, atol=1e-6)


def test_training_bias_updates_and_redundant_slots_keep_the_capacity_path() -> None:
    moving, _ = _pair(top_k=2, capacity_factor=0.0, expert_bias_update_rate=0.01)
    slots, _ = _pair(top_k=2, capacity_factor=0.0, redundant_experts=2)
    with torch.no_grad():
        moving.train()(torch.randn(4, M))
        slots(torch.randn(4, M))
    assert moving.last_stats.plan.source != SOURCE and bool(moving.gate.expert_bias.abs().sum() > 0)
    assert slots.last_stats.plan.source != SOURCE


def _ops_of_one_token(num_experts: int) -> collections.Counter[str]:
    torch.manual_seed(0)
    layer = MoELayer(M, H, num_experts, top_k=2, capacity_factor=0.0, activation="swiglu", bias=False,
                     aux_loss_weight=0.0)
    x = torch.randn(1, M)
    with torch.no_grad():
        layer(x)
        with OpCount() as count:
            layer(x)
    return count.counts


def test_one_token_runs_its_experts_gemms_and_few_other_ops() -> None:
    """At one token the forward is its k experts' GEMMs and a few dozen routing and gathering ops
    (the capacity path ran over a hundred), whatever the number of experts it did not pick."""
    few, many = _ops_of_one_token(8), _ops_of_one_token(64)
    assert few["aten.mm"] == 2 * 3 + 1  # w1, w3, w2 of the two experts picked, and the gate
    assert few == many
    assert sum(few.values()) <= 40, few  # 50 before the per-expert views and the no-op casts went
    assert "aten.select" not in few and "aten.detach" not in few and "aten._to_copy" not in few, few


@pytest.mark.parametrize(("activation", "bias"), [("gelu", True), ("swiglu", False), ("relu", True)])
def test_expert_by_expert_for_large_intermediates_equals_the_capacity_path(activation: str, bias: bool) -> None:
    """Above CACHE_RESIDENT_BYTES of intermediate each expert gathers and adds back its own rows."""
    torch.manual_seed(0)
    hidden, tokens = 256, 600
    reference = ReferenceMoE(M, hidden, E, top_k=2, capacity_factor=0.0, activation=activation, bias=bias)
    layer = MoELayer(M, hidden, E, top_k=2, capacity_factor=0.0, activation=activation, bias=bias)
    layer.load_full_state_dict(reference.state_dict())
    assert tokens * 2 * hidden * 4 > CACHE_RESIDENT_BYTES
    x = torch.randn(tokens, M)
    with torch.no_grad():
        direct = layer(x)
        assert layer.last_stats.plan.source == SOURCE
        expected = reference(x)
    torch.testing.assert_close(direct, layer(x).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(direct, expected, rtol=1e-5, atol=1e-6)


def test_new_weights_reach_the_next_direct_forward() -> None:
    """A load in place, a replaced parameter and a dtype change all reach the next direct forward."""
    layer, _ = _pair(top_k=2, capacity_factor=0.0, activation="swiglu", bias=False)
    x = torch.randn(3, M)
    with torch.no_grad():
        layer(x)
        other = ReferenceMoE(M, H, E, top_k=2, capacity_factor=0.0, activation="swiglu", bias=False)
        layer.load_full_state_dict(other.state_dict())  # copies in place
        torch.testing.assert_close(layer(x), other(x), rtol=1e-5, atol=1e-6)
        layer.experts.w2 = torch.nn.Parameter(layer.experts.w2 * 2)  # a new parameter
        other.experts.w2.mul_(2)
        torch.testing.assert_close(layer(x), other(x), rtol=1e-5, atol=1e-6)
        layer.double()
        assert layer(x.double()).dtype == torch.float64
        torch.testing.assert_close(layer(x.double()), other.double()(x.double()), rtol=1e-9, atol=1e-12)


def test_the_one_expert_loop_follows_replaced_storage_and_copies() -> None:
    """One token runs its experts one after the other over kept per-expert views: a weight whose
    storage is swapped (``.data =``), a moved copy and a deepcopy each compute with their own weights."""
    import copy

    layer, _ = _pair(top_k=2, capacity_factor=0.0, activation="swiglu", bias=False)
    x = torch.randn(1, M)
    with torch.no_grad():
        before = layer(x)
        twin = copy.deepcopy(layer)
        layer.experts.w1.data = layer.experts.w1.data * 3  # same parameter, new storage
        changed = layer(x)
        assert not torch.allclose(changed, before)
        torch.testing.assert_close(twin(x), before, rtol=0, atol=0)  # the copy kept its own weights
        twin.experts.w1.mul_(3)  # in place: the twin's kept views see it
        torch.testing.assert_close(twin(x), changed, rtol=0, atol=0)
        assert layer.experts.expert_views.of(layer.experts.weights().as_tuple())[0][0].data_ptr() == (
            layer.experts.w1.data_ptr())


def test_the_hf_block_bench_compares_the_same_function() -> None:
    pytest.importorskip("transformers")
    from moeflow.bench.hf_block import measure

    threads = torch.get_num_threads()
    try:
        records = measure([1, 3], repeats=2, experts=8, top_k=2, model_dim=64, hidden_dim=32)
    finally:
        torch.set_num_threads(threads)  # the bench pins one thread, as its entry point would
    assert [r["tokens"] for r in records] == [1, 3]
    for record in records:
        assert record["plan_source"] == SOURCE and record["max_abs_difference"] < 1e-5
        assert record["gemms_ms"] > 0 and record["fastest_over_moeflow"] > 0
