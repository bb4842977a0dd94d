"""Expert FFN kernels: every kernel and activation against per-expert dense math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow.core.clamped_swiglu import ClampedSwiGLU
from moeflow.core.experts import ExpertFFN, ffn_flops
from moeflow.kernels.ragged import FilledRows, looped_mm, ragged_mm, ragged_weight_grad, torch_grouped_mm_runs
from moeflow.parallel import ExpertPlacement
from moeflow.parallel.placement import shard_expert_state

CLAMP = ClampedSwiGLU(limit=0.5, alpha=1.702, up_offset=1.0)
"""gpt-oss's numbers with a cap low enough that many values are capped."""


def dense_ffn(experts: ExpertFFN, e: int, x: torch.Tensor) -> torch.Tensor:
    h = x @ experts.w1[e] + experts.b1[e]
    act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swiglu": F.silu}[experts.activation](h)
    if experts.activation == "swiglu":
        up = x @ experts.w3[e] + experts.b3[e]
        if isinstance(experts.compute.activation, ClampedSwiGLU):  # torch's own clamps and their gradients
            gate = h.clamp(max=CLAMP.limit)
            act, up = gate * torch.sigmoid(CLAMP.alpha * gate), up.clamp(-CLAMP.limit, CLAMP.limit) + CLAMP.up_offset
        act = act * up
    return act @ experts.w2[e] + experts.b2[e]


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu", "clamped-swiglu"])
@pytest.mark.parametrize("kernel", ["bmm", "loop"])
@pytest.mark.parametrize("tokens", [0, 5, 64])
def test_kernels_match_per_expert_dense_math(activation: str, kernel: str, tokens: int) -> None:
    torch.manual_seed(0)
    clamp = CLAMP if activation == "clamped-swiglu" else None
    experts = ExpertFFN(3, 6, 10, "swiglu" if clamp else activation, kernel, clamp=clamp).double()
    with torch.no_grad():
        experts.b1.normal_()
        experts.b2.normal_()
        if experts.b3 is not None:
            experts.b3.normal_()
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
    with pytest.raises(ValueError, match="unknown expert kernel 'fastest'"):
        ExpertFFN(2, 4, 4, kernel="fastest")


def test_flops_and_sharding() -> None:
    assert ffn_flops(10, 4, 8, "gelu", backward=False) == 2 * 10 * 4 * 8 * 2
    assert ffn_flops(10, 4, 8, "swiglu", backward=True) == 3 * 2 * 10 * 4 * 8 * 3
    full = {"gate.weight": torch.arange(4.0), "experts.b1": torch.arange(8.0).view(4, 2)}
    shard = shard_expert_state(full, ExpertPlacement.expert_parallel(4, 2, hidden_dim=2), rank=1)
    assert shard["experts.b1"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert shard["gate.weight"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="not divisible"):
        ExpertPlacement.expert_parallel(4, 3, hidden_dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 70, 1, 0, 3], [0, 0, 0], [0, 64, 0]])
def test_torch_grouped_gemm_equals_a_loop_of_matmuls_bit_for_bit(counts: list[int], dtype: torch.dtype) -> None:
    """The torch backend's ragged forward GEMM runs ``torch._grouped_mm`` on CPU: the same numbers
    as one ``mm`` per expert, transposed weights and experts with no rows included (and the weight
    gradient's loop gives each expert's product, zeros for none)."""
    generator = torch.Generator().manual_seed(sum(counts))
    experts, inner, cols = len(counts), 24, 40
    a_NK = torch.randn(sum(counts), inner, generator=generator).to(dtype)
    b_LKJ = torch.randn(experts, cols, inner, generator=generator).to(dtype).transpose(1, 2)
    g_NJ = torch.randn(sum(counts), cols, generator=generator).to(dtype)
    rows = FilledRows.of_experts(torch.repeat_interleave(torch.arange(experts), torch.tensor(counts)), experts)
    assert torch_grouped_mm_runs(a_NK, b_LKJ) == (torch.__version__ >= "2.9")
    assert torch.equal(ragged_mm(a_NK, b_LKJ, rows), looped_mm(a_NK, b_LKJ, rows))
    expected_LKJ = torch.stack([
        a.t() @ g if count else a.new_zeros(inner, cols)
        for a, g, count in zip(a_NK.split(counts), g_NJ.split(counts), counts, strict=True)
    ])
    assert torch.equal(ragged_weight_grad(a_NK, g_NJ, rows), expected_LKJ)


@pytest.mark.parametrize(("dtype", "inner", "cols"), [(torch.float64, 8, 8), (torch.float32, 6, 8),
                                                    (torch.float32, 8, 6), (torch.bfloat16, 12, 8)])
def test_torch_grouped_gemm_is_not_used_where_it_cannot_run(dtype: torch.dtype, inner: int, cols: int) -> None:
    """float64, and rows that do not span a multiple of 16 bytes, which it does not take (or whose
    output would not be contiguous), run the loop and get the same numbers; aligned fp32 runs it."""
    generator = torch.Generator().manual_seed(inner)
    a_NK = torch.randn(6, inner, generator=generator).to(dtype)
    b_LKJ, g_NJ = torch.randn(2, inner, cols, generator=generator).to(dtype), torch.randn(6, cols).to(dtype)
    rows = FilledRows.of_experts(torch.tensor([0, 0, 1, 1, 1, 1]), 2)
    assert not torch_grouped_mm_runs(a_NK, b_LKJ)
    assert torch.equal(ragged_mm(a_NK, b_LKJ, rows), torch.cat([a_NK[:2] @ b_LKJ[0], a_NK[2:] @ b_LKJ[1]]))
    assert torch.equal(ragged_weight_grad(a_NK, g_NJ, rows), torch.stack([a_NK[:2].t() @ g_NJ[:2],
                                                                          a_NK[2:].t() @ g_NJ[2:]]))
    aligned = torch.randn(6, 8), torch.randn(2, 8, 8)
    assert torch_grouped_mm_runs(*aligned) == (torch.__version__ >= "2.9")
