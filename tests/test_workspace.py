"""The layer's workspace: buffers come back step after step, and a buffer still read by a pending
backward is never handed out twice (two forwards before one backward, no-grad forwards between)."""

from __future__ import annotations

import torch

from moeflow import MoELayer
from moeflow.core.workspace import Workspace, share_workspace
from moeflow.reference import ReferenceMoE


def _pair(**kwargs: object) -> tuple[ReferenceMoE, MoELayer]:
    torch.manual_seed(0)
    reference = ReferenceMoE(8, 16, 4, **kwargs)  # type: ignore[arg-type]
    layer = MoELayer(8, 16, 4, **kwargs)  # type: ignore[arg-type]
    layer.load_full_state_dict(reference.state_dict())
    return reference, layer


def test_a_buffer_is_reused_only_once_nothing_references_it() -> None:
    workspace = Workspace()
    like = torch.zeros(1)
    first = workspace.take((4, 5), like)
    pointer = first.data_ptr()
    view = first[1:]  # a view keeps the storage in use
    del first
    workspace.start_step()
    assert workspace.take((4, 5), like).data_ptr() != pointer  # the view still uses it
    del view
    assert workspace.pooled_bytes == 2 * 4 * 5 * 4  # both are free now
    again = workspace.take((4, 5), like)
    assert again.data_ptr() == pointer and again.shape == (4, 5) and again.is_contiguous()
    assert workspace.take((4, 5), like).data_ptr() != pointer  # never handed out twice at once


def test_stale_shapes_and_extra_buffers_are_dropped() -> None:
    workspace = Workspace()
    like = torch.zeros(1)
    held = [workspace.take((2, 2), like) for _ in range(3)]
    del held
    workspace.start_step()
    workspace.take((2, 2), like)  # this step needs one (2, 2) buffer
    workspace.start_step()
    assert workspace.pooled_bytes == 2 * 2 * 4
    workspace.start_step()  # (2, 2) was not taken in that step: dropped
    assert workspace.pooled_bytes == 0


def test_a_gradient_the_user_keeps_is_never_written_over() -> None:
    _, layer = _pair()
    x = torch.randn(32, 8)
    (layer(x).sum() + layer.aux_loss).backward()
    kept = layer.experts.w1.grad
    snapshot = kept.clone()
    layer.zero_grad(set_to_none=True)
    (layer(2 * x).sum() + layer.aux_loss).backward()
    assert layer.experts.w1.grad.data_ptr() != kept.data_ptr()
    torch.testing.assert_close(kept, snapshot, rtol=0, atol=0)
    del kept
    layer.zero_grad(set_to_none=True)
    (layer(x).sum() + layer.aux_loss).backward()
    torch.testing.assert_close(layer.experts.w1.grad, snapshot, rtol=0, atol=0)


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


def test_a_new_shape_drops_the_free_buffers_of_shapes_this_step_has_not_taken() -> None:
    workspace = Workspace()
    like = torch.zeros(1)
    kept_in_use = workspace.take((3, 3), like)
    workspace.take((2, 2), like)  # free at once
    workspace.start_step()
    workspace.take((4, 4), like)  # another plan's shape: the free (2, 2) goes, the used (3, 3) stays
    assert workspace.pooled_bytes == 4 * 4 * 4
    del kept_in_use
    assert workspace.pooled_bytes == (4 * 4 + 3 * 3) * 4


def _stack(shared: bool) -> tuple[list[MoELayer], Workspace | None]:
    torch.manual_seed(0)
    layers = [MoELayer(8, 32, 4, capacity_factor=2.0) for _ in range(3)]
    return layers, share_workspace(layers) if shared else None


def _train_stack(layers: list[MoELayer], x: torch.Tensor) -> list[torch.Tensor]:
    for _ in range(3):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        y = x
        for layer in layers:
            y = y + layer(y)
        (y.square().sum() + sum(layer.aux_loss for layer in layers)).backward()
    return [layer.experts.w1.grad.clone() for layer in layers]


def test_layers_sharing_a_workspace_hold_one_set_of_backward_buffers() -> None:
    x = torch.randn(32, 8)
    separate, _ = _stack(shared=False)
    shared_layers, shared = _stack(shared=True)
    expected, actual = _train_stack(separate, x), _train_stack(shared_layers, x)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert shared is not None and all(layer.workspace is shared for layer in shared_layers)
    held_apart = sum(layer.workspace.pooled_bytes for layer in separate)
    assert 0 < shared.pooled_bytes < held_apart * 0.8  # the layers' backward buffers are reused in turn
    with torch.no_grad():  # a no-grad forward gives the free training buffers back first
        shared_layers[0](x)
    assert shared.pooled_bytes == 0


def test_the_experts_intermediates_go_through_saved_tensor_hooks() -> None:
    reference, layer = _pair(capacity_factor=0.0)
    x = torch.randn(32, 8)
    hidden_shaped: list[tuple[int, ...]] = []
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        is_parameter = tensor.untyped_storage().data_ptr() in parameters
        if tensor.dim() == 3 and tensor.shape[-1] == 16 and not is_parameter:  # (E, C, hidden): h, act(h)
            hidden_shaped.append(tuple(tensor.shape))
        return tensor.clone()  # as an offloading hook would: the original buffer is free again

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    (reference(x).square().sum() + reference.aux_loss).backward()
    assert len(hidden_shaped) >= 2  # h and act(h)
    torch.testing.assert_close(layer.experts.w1.grad, reference.experts.w1.grad, rtol=2e-5, atol=2e-5)
