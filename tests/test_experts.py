"""Expert FFN kernels: every kernel and activation against per-expert dense math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow.experts import ExpertFFN, ffn_flops, shard_expert_state
from moeflow.parallel import ExpertPlacement


def dense_ffn(experts: ExpertFFN, e: int, x: torch.Tensor) -> torch.Tensor:
    h = x @ experts.w1[e] + experts.b1[e]
    act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swiglu": F.silu}[experts.activation](h)
    if experts.activation == "swiglu":
        act = act * (x @ experts.w3[e])
    return act @ experts.w2[e] + experts.b2[e]


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
@pytest.mark.parametrize("kernel", ["bmm", "loop"])
@pytest.mark.parametrize("tokens", [0, 5, 64])
def test_kernels_match_per_expert_dense_math(activation: str, kernel: str, tokens: int) -> None:
    torch.manual_seed(0)
    experts = ExpertFFN(3, 6, 10, activation, kernel).double()
    with torch.no_grad():
        experts.b1.normal_()
        experts.b2.normal_()
    x = torch.randn(3, tokens, 6, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, tokens, 6, dtype=torch.float64)
    (experts(x) * upstream).sum().backward()
    got = {n: p.grad.clone() for n, p in experts.named_parameters()} | {"x": x.grad.clone()}
    experts.zero_grad()
    x_ref = x.detach().clone().requires_grad_()
    expected_y = torch.stack([dense_ffn(experts, e, x_ref[e]) for e in range(3)])
    (expected_y * upstream).sum().backward()
    expected = {n: p.grad for n, p in experts.named_parameters()} | {"x": x_ref.grad}
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-10, atol=1e-10, msg=name)


def test_one_expert_equals_a_dense_ffn() -> None:
    torch.manual_seed(1)
    experts = ExpertFFN(1, 8, 16, "gelu")
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with torch.no_grad():
        mlp[0].weight.copy_(experts.w1[0].t())
        mlp[0].bias.copy_(experts.b1[0])
        mlp[2].weight.copy_(experts.w2[0].t())
        mlp[2].bias.copy_(experts.b2[0])
    x = torch.randn(1, 11, 8)
    torch.testing.assert_close(experts(x)[0], mlp(x[0]))


def test_unknown_kernel_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown expert kernel 'auto'"):
        ExpertFFN(2, 4, 4, kernel="auto")


def test_flops_and_sharding() -> None:
    assert ffn_flops(10, 4, 8, "gelu", backward=False) == 2 * 10 * 4 * 8 * 2
    assert ffn_flops(10, 4, 8, "swiglu", backward=True) == 3 * 2 * 10 * 4 * 8 * 3
    full = {"gate.weight": torch.arange(4.0), "experts.b1": torch.arange(8.0).view(4, 2)}
    shard = shard_expert_state(full, ExpertPlacement.expert_parallel(4, 2, hidden_dim=2), rank=1)
    assert shard["experts.b1"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert shard["gate.weight"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="not divisible"):
        ExpertPlacement.expert_parallel(4, 3, hidden_dim=2)
