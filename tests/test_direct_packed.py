"""The kept-rows path (moeflow.direct_packed): a training forward on one rank under the ragged kernel
runs with no capacity buffer, and computes the capacity path's function, gradients included."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from moeflow import MoELayer
from moeflow.core.routing import assign_slots
from moeflow.kernels.slot_gather import encode, make_packed_slot_map, make_slot_map
from moeflow.parallel.dispatchers.stats import SOURCE
from moeflow.reference import ReferenceMoE

M, H, E = 16, 24, 8
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


def _pair(**settings: Any) -> tuple[MoELayer, ReferenceMoE]:
    torch.manual_seed(0)
    reference_settings = {k: v for k, v in settings.items() if k in inspect.signature(ReferenceMoE).parameters}
    reference = ReferenceMoE(M, H, E, **reference_settings)
    layer = MoELayer(M, H, E, expert_kernel="ragged", **settings)
    layer.load_full_state_dict(reference.state_dict())
    return layer, reference


def _forward_backward(module: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output, the input's gradient and every parameter's gradient."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = module(x)
    (y * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return {"y": y.detach(), "x.grad": x.grad.clone(), **grads}


def _capacity_path(layer: MoELayer) -> MoELayer:
    """The same layer forced onto the capacity path (what every forward took before the kept-rows path)."""
    layer.dispatchers = dataclasses.replace(layer.dispatchers, declared=None)
    return layer


CASES = [
    {"top_k": 3, "capacity_factor": 1.0},  # drops
    {"top_k": 2, "capacity_factor": 0.5, "activation": "relu"},  # drops many
    {"top_k": 2, "capacity_factor": 0.0, "activation": "swiglu", "bias": False, "num_shared_experts": 1},
    {"top_k": 2, "capacity_factor": 1.0, "batch_prioritized_routing": True},  # which tokens drop: by priority
    {"top_k": 1, "capacity_factor": -1.5, "gate": "cosine"},
]


@pytest.mark.parametrize("settings", CASES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_packed_path_equals_the_reference_and_the_capacity_path(settings: dict) -> None:
    layer, reference = _pair(**settings)
    generator = torch.Generator().manual_seed(1)
    x, upstream = torch.randn(2, 29, M, generator=generator), torch.randn(2, 29, M, generator=generator)
    packed = _forward_backward(layer, x, upstream)
    packed_stats = layer.last_stats
    assert packed_stats.plan.source == SOURCE and packed_stats.plan.expert_kernel == "ragged"
    expected = _forward_backward(reference, x, upstream)
    assert {"y", "x.grad", "gate.weight", "experts.w1", "experts.w2"} <= set(packed) and set(packed) >= set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(packed[name], value, **TIGHT, msg=name)
    capacity = _forward_backward(_capacity_path(layer), x, upstream)
    assert layer.last_stats.plan.source != SOURCE
    for name, value in capacity.items():
        torch.testing.assert_close(packed[name], value, rtol=0, atol=1e-6, msg=name)
    assert packed_stats.dropped_per_expert == layer.last_stats.dropped_per_expert
    assert packed_stats.tokens_per_expert == layer.last_stats.tokens_per_expert
    assert packed_stats.capacity == layer.last_stats.capacity


def test_a_dropping_forward_counts_its_drops() -> None:
    layer, _ = _pair(top_k=2, capacity_factor=0.5)
    layer(torch.randn(40, M))
    stats = layer.last_stats
    assert stats.plan.source == SOURCE and stats.dropped > 0
    assert stats.dropped == sum(max(0, count - stats.capacity) for count in stats.tokens_per_expert)


def test_packed_path_in_bf16_matches_the_capacity_path() -> None:
    layer, _ = _pair(top_k=2, capacity_factor=1.0, activation="swiglu", bias=False)
    layer = layer.bfloat16()
    x, upstream = torch.randn(33, M).bfloat16(), torch.randn(33, M).bfloat16()
    packed = _forward_backward(layer, x, upstream)
    assert layer.last_stats.plan.source == SOURCE and packed["y"].dtype == torch.bfloat16
    capacity = _forward_backward(_capacity_path(layer), x, upstream)
    for name, value in capacity.items():
        torch.testing.assert_close(packed[name].float(), value.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_activation_checkpointing_recomputes_the_packed_path() -> None:
    layer, _ = _pair(top_k=2, capacity_factor=1.0)
    x, upstream = torch.randn(21, M), torch.randn(21, M)
    plain = _forward_backward(layer, x, upstream)

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    wrapped = Checkpointed()
    leaf = x.detach().requires_grad_()
    with set_checkpoint_early_stop(False):  # the recompute runs the whole forward, stats included
        y = wrapped(leaf)
    stats = layer.last_stats  # the forward's, read before the backward recomputes it
    (y * upstream).sum().backward()
    assert layer.last_stats is stats and stats.plan.source == SOURCE  # the recompute counted nothing
    recomputed = _forward_backward(wrapped, x, upstream)
    for name, value in plain.items():
        torch.testing.assert_close(recomputed.get(name, recomputed.get(f"inner.{name}")), value, rtol=0, atol=0,
                                   msg=name)


def test_padded_kernels_and_a_moving_bias_keep_the_capacity_path() -> None:
    torch.manual_seed(0)
    padded = MoELayer(M, H, E, top_k=2, expert_kernel="bmm")
    moving = MoELayer(M, H, E, top_k=2, expert_kernel="ragged", expert_bias_update_rate=0.01).train()
    for layer in (padded, moving):
        layer(torch.randn(12, M))
        assert layer.last_stats.plan.source != SOURCE
    assert bool(moving.gate.expert_bias.abs().sum() > 0)


def test_the_packed_plan_holds_the_capacity_buffers_filled_slots_in_order() -> None:
    generator = torch.Generator().manual_seed(3)
    x_TM = torch.randn(30, M, generator=generator)
    expert_idx_TK = torch.rand(30, E, generator=generator).topk(2, dim=1).indices
    location_TK, counts_E = assign_slots(expert_idx_TK, E)
    capacity = 7
    padded_ECM = encode(x_TM, make_slot_map(expert_idx_TK, location_TK, E, capacity))
    plan = make_packed_slot_map(expert_idx_TK, location_TK, counts_E, capacity)
    packed_NM = encode(x_TM, plan)
    kept = counts_E.clamp(max=capacity)
    assert plan.num_slots == int(kept.sum()) == packed_NM.shape[0] and plan.empty_slots.numel() == 0
    expected = torch.cat([padded_ECM[e, : int(kept[e])] for e in range(E)])
    torch.testing.assert_close(packed_NM, expected, rtol=0, atol=0)


def test_a_forward_with_no_tokens_takes_the_packed_path() -> None:
    layer, _ = _pair(top_k=2, capacity_factor=1.0, activation="swiglu")
    x = torch.randn(0, M, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, M) and x.grad.shape == (0, M) and layer.last_stats.plan.source == SOURCE
    assert layer.last_stats.num_tokens == 0 and float(layer.experts.w1.grad.abs().sum()) == 0.0
