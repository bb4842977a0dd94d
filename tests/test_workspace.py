"""The layer's workspace: buffers come back step after step, and a buffer still read by a pending
backward is never handed out twice (two forwards before one backward, no-grad forwards between)."""

from __future__ import annotations

import torch

from moeflow import MoELayer
from moeflow.reference import ReferenceMoE
from moeflow.workspace import Workspace


def _pair(**kwargs: object) -> tuple[ReferenceMoE, MoELayer]:
    torch.manual_seed(0)
    reference = ReferenceMoE(8, 16, 4, **kwargs)  # type: ignore[arg-type]
    layer = MoELayer(8, 16, 4, **kwargs)  # type: ignore[arg-type]
    layer.load_full_state_dict(reference.state_dict())
    return reference, layer


def test_buffers_are_reused_and_stale_shapes_dropped() -> None:
    workspace = Workspace()
    like = torch.zeros(1)
    first = workspace.take((4, 5), like)
    workspace.give(first)
    workspace.start_step()
    assert workspace.take((4, 5), like).data_ptr() == first.data_ptr()
    workspace.give(torch.empty(2, 2))
    workspace.start_step()  # (2, 2) was not taken in that step: dropped
    workspace.start_step()
    assert workspace.pooled_bytes == 0


def test_the_layer_reuses_its_buffers_across_steps() -> None:
    _, layer = _pair(activation="swiglu")
    x = torch.randn(32, 8)
    for _ in range(2):
        (layer(x).sum() + layer.aux_loss).backward()
    pooled = layer.workspace.pooled_bytes
    (layer(x).sum() + layer.aux_loss).backward()
    assert pooled > 0 and layer.workspace.pooled_bytes == pooled  # nothing new kept, nothing lost


def test_two_forwards_before_one_backward_match_the_reference() -> None:
    for activation in ("gelu", "swiglu"):
        reference, layer = _pair(activation=activation, capacity_factor=0.0)
        xs = [torch.randn(24, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
        with torch.no_grad():
            layer(xs[2])  # a no-grad forward in between gives its buffers back at once
        losses = []
        for module in (reference, layer):
            first = module(xs[0]).square().sum()
            second = module(xs[1]).pow(3).sum()
            losses.append(first + second)
        for loss in losses:
            loss.backward()
        for name, expected in reference.named_parameters():
            if name.startswith("experts."):
                actual = getattr(layer.experts, name.split(".")[1]).grad
                torch.testing.assert_close(actual, expected.grad, rtol=2e-5, atol=2e-5, msg=f"{activation} {name}")


def test_a_copied_layer_computes_the_same_with_its_own_workspace() -> None:
    import copy

    _, layer = _pair()
    x = torch.randn(16, 8)
    with torch.no_grad():  # (a training forward leaves aux_loss in a graph, which torch cannot copy)
        layer(x)
    clone = copy.deepcopy(layer)
    assert clone.workspace is not layer.workspace and clone.groups is layer.groups
    torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)
