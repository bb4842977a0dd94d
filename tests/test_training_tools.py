"""The training tools people already use work on the layer (issue 41): activation checkpointing
in both modes (one process, and 2 processes with the planner timing a different plan at every
call), ``copy.deepcopy`` after a forward, ``torch.compile``; each gives the plain layer's outputs
and gradients."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from moeflow import MoELayer
from pool import run_distributed

M, H, E = 16, 32, 4


def _layer(world_size: int = 1, **settings: Any) -> MoELayer:
    torch.manual_seed(0)
    group = dist.group.WORLD if world_size > 1 else None
    return MoELayer(M, H, E, top_k=2, group=group, **settings)


def _step(layer: MoELayer, x: torch.Tensor, mode: str, call: Any = None) -> dict[str, np.ndarray]:
    """One forward and backward of ``layer`` (called as ``call``, default itself) run plainly or
    under checkpointing ``mode``; the output, the input's gradient and every parameter's, which
    are then cleared."""
    x = x.detach().requires_grad_(True)
    call = layer if call is None else call
    y = call(x) if mode == "plain" else checkpoint(call, x, use_reentrant=mode == "reentrant")
    (y.square().sum() + layer.aux_loss).backward()
    result = {"y": y.detach().numpy().copy(), "x": x.grad.numpy().copy()}
    for name, parameter in layer.named_parameters():
        result[name] = parameter.grad.numpy().copy()
    layer.zero_grad(set_to_none=True)
    return result


def _assert_equal(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], label: str) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{label}: {name}")


@pytest.mark.parametrize("settings", [{}, {"pipeline": 2, "activation": "swiglu", "capacity_factor": 0.0}])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_gives_the_plain_gradients(mode: str, settings: dict[str, Any]) -> None:
    # the reentrant mode runs the forward without a graph, so aux_loss has none: no gradient reaches it
    layer = _layer(**settings, aux_loss_weight=0.01 if mode == "non-reentrant" else 0.0)
    x = torch.randn(4, 8, M)
    expected = _step(layer, x, "plain")
    _assert_equal(_step(layer, x, mode), expected, mode)
    assert layer.last_stats is not None


def test_a_recompute_in_eval_mode_after_training_forwards_routes_with_the_current_bias() -> None:
    """Training forwards move the balancing bias; a later forward that does not (eval mode, with
    gradients: fine-tuning a frozen router, saliency) must be recomputed with the bias it saw."""
    layer = _layer(expert_bias_update_rate=0.05, aux_loss_weight=0.0)
    for seed in range(3):  # training forwards, no checkpointing: each moves the bias
        layer(torch.randn(4, 8, M, generator=torch.Generator().manual_seed(seed)))
    layer.eval()
    x = torch.randn(4, 8, M)
    expected = _step(layer, x, "plain")
    _assert_equal(_step(layer, x, "non-reentrant"), expected, "eval recompute")


def test_a_no_grad_forward_between_a_checkpointed_forward_and_its_backward_leaves_its_recompute_alone() -> None:
    """A forward without grad (a probe, an evaluation batch) before the backward is never recomputed:
    it keeps no record, so the recompute still finds its own forward's plan and bias."""
    settings = {"expert_bias_update_rate": 0.05, "aux_loss_weight": 0.0, "pipeline": "search",
                "capacity_factor": 0.0}
    plain, checkpointed = _layer(**settings), _layer(**settings)
    x = torch.randn(4, 8, M)
    expected = _step(plain, x, "plain")
    leaf = x.detach().requires_grad_(True)
    y = checkpoint(checkpointed, leaf, use_reentrant=False)
    with torch.no_grad():
        checkpointed(torch.randn(4, 8, M))  # moves the bias too (training mode)
    y.square().sum().backward()
    np.testing.assert_allclose(leaf.grad.numpy(), expected["x"], rtol=1e-5, atol=1e-6)
    for name, parameter in checkpointed.named_parameters():
        np.testing.assert_allclose(parameter.grad.numpy(), expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _twice(layer: MoELayer, x: torch.Tensor, mode: str) -> dict[str, np.ndarray]:
    """The layer called twice on same-shaped inputs in one step (each call checkpointed)."""
    x = x.detach().requires_grad_(True)
    halves = x.chunk(2)
    if mode == "plain":
        y = layer(halves[0]) * 2 + layer(halves[1])
    else:
        y = checkpoint(layer, halves[0], use_reentrant=False) * 2 + checkpoint(layer, halves[1], use_reentrant=False)
    y.square().sum().backward()
    result = {"y": y.detach().numpy().copy(), "x": x.grad.numpy().copy()}
    result |= {name: p.grad.numpy().copy() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return result


def _checkpointed(rank: int, world_size: int) -> dict[str, Any]:
    """The planner times a different pipeline degree and algorithm at each call ('search'): the
    recompute in the backward must take its forward's plan, or its saved tensors differ."""
    layer = _layer(world_size, pipeline="search", capacity_factor=0.0, expert_bias_update_rate=0.01,
                   aux_loss_weight=0.0)  # the reentrant mode cannot carry its gradient
    x = torch.randn(64, M, generator=torch.Generator().manual_seed(rank))
    results: dict[str, Any] = {}
    for step in range(3):
        for mode in ("plain", "reentrant", "non-reentrant"):
            bias = layer.gate.expert_bias.clone()
            results[f"{step}/{mode}"] = _step(layer, x, mode)
            results[f"{step}/{mode}/bias moved"] = float((layer.gate.expert_bias - bias).abs().sum())
            layer.gate.expert_bias.copy_(bias)  # every mode starts from the same routing
        for mode in ("plain", "non-reentrant"):
            bias = layer.gate.expert_bias.clone()
            results[f"{step}/twice {mode}"] = _twice(layer, x, mode)
            layer.gate.expert_bias.copy_(bias)
    return results


@pytest.mark.distributed
def test_both_checkpointing_modes_on_two_processes_while_the_planner_searches() -> None:
    for rank, results in enumerate(run_distributed(_checkpointed, 2, timeout_s=180)):
        for step in range(3):
            for mode in ("reentrant", "non-reentrant"):
                _assert_equal(results[f"{step}/{mode}"], results[f"{step}/plain"], f"rank {rank} step {step} {mode}")
                # the recompute does not update the loss-free balancing bias a second time
                assert results[f"{step}/{mode}/bias moved"] == pytest.approx(results[f"{step}/plain/bias moved"])
            # the same layer twice in one step: each recompute takes its own call's plan and bias
            _assert_equal(results[f"{step}/twice non-reentrant"], results[f"{step}/twice plain"], f"rank {rank} twice")


def test_deepcopy_after_a_forward_gives_an_independent_equal_layer() -> None:
    layer = _layer(aux_loss_weight=0.1)
    x = torch.randn(4, 8, M)
    y = layer(x)
    twin = copy.deepcopy(layer)  # an EMA or teacher copy, taken while the graph is alive
    assert not twin.aux_loss.requires_grad and twin.aux_loss.item() == pytest.approx(layer.aux_loss.item())
    assert all(p.skip_allreduce for p in twin.experts.parameters())  # still marked for data parallelism
    torch.testing.assert_close(twin(x), y, rtol=0, atol=0)
    with torch.no_grad():
        twin.experts.w1.add_(1.0)
    assert not torch.equal(twin.experts.w1, layer.experts.w1)
    (y.sum() + layer.aux_loss).backward()  # the original's graph still runs
    assert layer.experts.w1.grad is not None and twin.experts.w1.grad is None


@pytest.mark.slow
def test_torch_compile_runs_and_matches() -> None:
    """Graph breaks (data-dependent shapes of capacity routing, host reads, the planner's timing)
    are listed in the guide; here: the compiled layer (AOT autograd, no code generation, to keep
    the test short) gives the eager outputs and gradients over several calls."""
    layer = _layer(activation="swiglu")
    compiled = torch.compile(layer, backend="aot_eager")
    for seed in range(3):
        x = torch.randn(4, 8, M, generator=torch.Generator().manual_seed(seed))
        _assert_equal(_step(layer, x, "plain", compiled), _step(layer, x, "plain"), f"call {seed}")
