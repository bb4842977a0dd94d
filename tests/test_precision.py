"""Mixed precision: bf16/fp16 activations and expert GEMMs over fp32 master weights, the router in
fp32. Under autocast (or with low-precision x) over fp32 parameters the layer computes exactly what
the same layer with its parameters cast computes, and the gradients reach the fp32 parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from moeflow import MoELayer
from moeflow.reference import ReferenceMoE


def _layers(dtype: torch.dtype, **kwargs) -> tuple[MoELayer, MoELayer]:
    """fp32 master weights that ``dtype`` holds exactly (so that casting them loses nothing: the
    fp32 router then sees the same weights on both sides), and a copy cast to ``dtype``."""
    torch.manual_seed(0)
    master = MoELayer(16, 24, 8, top_k=2, **kwargs)
    with torch.no_grad():
        for name, param in master.named_parameters():
            if name.endswith(("b1", "b2", "b3")):
                param.normal_(std=0.1)
            param.copy_(param.to(dtype).float())
    return master, copy.deepcopy(master).to(dtype)


def _run(layer: MoELayer, x: torch.Tensor, autocast: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = layer(x)
    (y.float().square().sum() + layer.aux_loss).backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kwargs", [{}, {"activation": "swiglu", "bias": False, "capacity_factor": 0.0,
                                         "num_shared_experts": 1, "shared_expert_gate": True, "expert_kernel": "bmm"},
                                    {"expert_kernel": "ragged", "capacity_factor": 0.0, "pipeline": 2}])
def test_autocast_over_fp32_master_weights_equals_the_cast_layer(dtype: torch.dtype, kwargs: dict) -> None:
    master, low = _layers(dtype, **kwargs)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    y, grad_x = _run(master, x, autocast=dtype)
    y_low, grad_x_low = _run(low, x.to(dtype), autocast=None)
    assert y.dtype == dtype and grad_x.dtype == torch.float32
    torch.testing.assert_close(y, y_low, rtol=0, atol=0)
    torch.testing.assert_close(grad_x, grad_x_low.float(), rtol=0, atol=0)
    for (name, param), low_param in zip(master.named_parameters(), low.parameters(), strict=True):
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, name
        if name == "gate.weight":  # fp32 logits from the cast weight: the same sums, in fp32 on the master side
            torch.testing.assert_close(param.grad, low_param.grad.float(), rtol=1e-2, atol=1e-3, msg=name)
        else:
            torch.testing.assert_close(param.grad, low_param.grad.float(), rtol=0, atol=0, msg=name)
    assert master.last_stats.tokens_per_expert == low.last_stats.tokens_per_expert


def test_bf16_input_over_fp32_parameters_routes_in_fp32_like_the_reference() -> None:
    torch.manual_seed(0)
    reference = ReferenceMoE(16, 24, 8, top_k=2)
    layer = MoELayer(16, 24, 8, top_k=2)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = layer(x)
    y_reference = reference(x.float())  # the fp32 function of the same (bf16-rounded) input
    assert layer.last_stats.tokens_per_expert == reference.tokens_per_expert
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(y.float(), y_reference, rtol=8 * eps, atol=8 * eps)


def test_an_unsupported_dtype_pairing_names_the_fix() -> None:
    layer = MoELayer(16, 24, 8).bfloat16()
    with pytest.raises(ValueError, match=r"x has dtype torch.float32 but the layer's parameters are torch.bfloat16"):
        layer(torch.randn(4, 16))
    with pytest.raises(ValueError, match=r"layer.to\(torch.float64\) or x.to\(torch.float32\)"):
        MoELayer(16, 24, 8)(torch.randn(4, 16, dtype=torch.float64))
