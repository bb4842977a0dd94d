"""``MoELayer.load_full_state_dict`` takes a state dict without the auxiliary-loss-free selection
bias (a converted model's has none): a strict load sets it to zero; one that holds it sets it."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer


def _layers() -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(0)
    source = MoELayer(8, 16, 4, top_k=2, expert_bias_update_rate=0.1)
    target = MoELayer(8, 16, 4, top_k=2, expert_bias_update_rate=0.1)
    with torch.no_grad():
        target.gate.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.25, 0.0]))  # as a trained layer's
    return source, target


def test_a_state_without_the_selection_bias_loads_strictly_and_zeroes_it() -> None:
    source, target = _layers()
    state = {name: t for name, t in source.state_dict().items() if name != "gate.expert_bias"}
    target.load_full_state_dict(state)
    assert torch.equal(target.gate.expert_bias, torch.zeros(4))
    assert all(torch.equal(target.state_dict()[name], t) for name, t in state.items())
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


def test_a_state_with_the_selection_bias_sets_it() -> None:
    source, target = _layers()
    state = source.state_dict()
    state["gate.expert_bias"] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    target.load_full_state_dict(state)
    assert torch.equal(target.gate.expert_bias, torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_a_non_strict_load_keeps_what_the_state_does_not_name() -> None:
    source, target = _layers()
    bias = target.gate.expert_bias.clone()
    target.load_full_state_dict({"gate.weight": source.gate.weight.detach()}, strict=False)
    assert torch.equal(target.gate.expert_bias, bias)
    assert torch.equal(target.gate.weight, source.gate.weight)


def test_other_missing_entries_are_still_refused() -> None:
    source, target = _layers()
    state = {name: t for name, t in source.state_dict().items() if name != "experts.w1"}
    with pytest.raises(RuntimeError, match=r"experts\.w1"):
        target.load_full_state_dict(state)
