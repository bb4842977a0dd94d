"""The Triton kernels equal the torch path: fused encode/decode and the ragged grouped GEMMs,
outputs and gradients, k up to 8, experts with no tokens, dropped tokens, empty inputs. On a CPU
they run under TRITON_INTERPRET=1 (set by conftest before Triton is imported); on a machine with a
GPU they run compiled, on CUDA tensors (the routing and row counts stay on the host, as in the layer)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moeflow.core.routing import assign_slots
from moeflow.kernels import resolve_backend
from moeflow.kernels.ragged import FilledRows, ragged_mm, ragged_weight_grad
from moeflow.kernels.slot_gather import decode, encode, make_slot_map

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

FP32 = {"rtol": 1e-5, "atol": 1e-5}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled on a GPU, interpreted on a CPU


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.to(DEVICE) for tensor in tensors)


def bf16_tolerance(terms: int) -> dict[str, float]:
    """A sum of ``terms`` bf16 products rounded once at the end (the kernels accumulate in fp32)
    against torch's bf16 ops, which may round at every step: a few ulps of eps = 2^-8 per term."""
    eps = torch.finfo(torch.bfloat16).eps
    return {"rtol": 2 * eps * terms**0.5, "atol": 2 * eps * terms**0.5}


def _plan(tokens: int, experts: int, k: int, capacity: int, seed: int, hot: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    if hot is None:
        picks = [torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)]
        expert_idx_TK = torch.stack(picks) if picks else torch.zeros(0, k, dtype=torch.int64)
    else:  # every token picks the same k experts: the others get no token
        expert_idx_TK = torch.arange(hot, hot + k).remainder(experts).repeat(tokens, 1)
    location_TK, _ = assign_slots(expert_idx_TK.reshape(tokens, k), experts, None)
    expert_idx_TK, location_TK = on_device(expert_idx_TK.reshape(tokens, k), location_TK)
    return make_slot_map(expert_idx_TK, location_TK, experts, capacity)


def _encode_decode(backend: str, x_TM: torch.Tensor, weights_TK: torch.Tensor, plan, upstream_TM: torch.Tensor):
    x_TM = x_TM.clone().requires_grad_()
    weights_TK = weights_TK.clone().requires_grad_()
    buffer_ECM = encode(x_TM, plan, backend=backend)
    y_TM = decode(buffer_ECM * 1.5 + 0.25, weights_TK, plan, backend=backend)
    (y_TM.float() * upstream_TM).sum().backward()
    return buffer_ECM.detach(), y_TM.detach(), x_TM.grad, weights_TK.grad


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "capacity", "hot"),
    [(37, 8, 1, 6, None), (37, 8, 2, 12, None), (29, 8, 4, 9, None), (23, 8, 8, 23, None),
     (23, 8, 8, 5, None), (30, 16, 2, 31, 3), (0, 4, 2, 3, None), (5, 4, 2, 0, None)],
)
def test_encode_decode_match_torch(tokens: int, experts: int, k: int, capacity: int, hot: int | None) -> None:
    plan = _plan(tokens, experts, k, capacity, seed=tokens + k, hot=hot)
    generator = torch.Generator().manual_seed(1)
    x_TM = torch.randn(tokens, 40, generator=generator)
    weights_TK = torch.rand(tokens, k, generator=generator)
    upstream_TM = torch.randn(tokens, 40, generator=generator)
    x_TM, weights_TK, upstream_TM = on_device(x_TM, weights_TK, upstream_TM)
    expected = _encode_decode("torch", x_TM, weights_TK, plan, upstream_TM)
    got = _encode_decode("triton", x_TM, weights_TK, plan, upstream_TM)
    for name, want, have in zip(("buffer", "y", "grad x", "grad weights"), expected, got, strict=True):
        torch.testing.assert_close(have, want, **FP32, msg=name)
    if hot is not None:  # the experts no token chose hold only zeros
        assert got[0][(torch.arange(experts, device=DEVICE) - hot) % experts >= k].abs().sum() == 0


def test_encode_decode_in_bf16() -> None:
    plan = _plan(41, 8, 4, 16, seed=5)
    generator = torch.Generator().manual_seed(2)
    x_TM = torch.randn(41, 96, generator=generator).bfloat16()
    weights_TK = torch.rand(41, 4, generator=generator).bfloat16()
    upstream_TM = torch.randn(41, 96, generator=generator)
    x_TM, weights_TK, upstream_TM = on_device(x_TM, weights_TK, upstream_TM)
    expected = _encode_decode("torch", x_TM, weights_TK, plan, upstream_TM)
    got = _encode_decode("triton", x_TM, weights_TK, plan, upstream_TM)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)  # a copy is exact
    for name, want, have, terms in zip(("y", "grad x", "grad weights"), expected[1:], got[1:], (4, 4, 96),
                                       strict=True):
        torch.testing.assert_close(have.float(), want.float(), **bf16_tolerance(terms), msg=name)


def _loop_reference(a_NK: torch.Tensor, b_LKJ: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([a @ b_LKJ[expert] for expert, a in enumerate(a_NK.split(counts))])


@pytest.mark.parametrize("counts", [[5, 0, 70, 1, 0, 3], [0, 0, 0], [129], [0, 64, 0]])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_gemms_match_a_loop_of_matmuls(counts: list[int], transposed: bool) -> None:
    generator = torch.Generator().manual_seed(sum(counts))
    rows, experts, inner, cols = sum(counts), len(counts), 40, 72
    a_NK = torch.randn(rows, inner, generator=generator)
    b_LKJ = torch.randn(experts, cols, inner, generator=generator).transpose(1, 2) if transposed else (
        torch.randn(experts, inner, cols, generator=generator))
    g_NJ = torch.randn(rows, cols, generator=generator)
    a_NK, b_LKJ, g_NJ = on_device(a_NK, b_LKJ, g_NJ)
    filled = FilledRows.of_experts(torch.repeat_interleave(torch.arange(experts), torch.tensor(counts)), experts)
    torch.testing.assert_close(ragged_mm(a_NK, b_LKJ, filled, "triton"), _loop_reference(a_NK, b_LKJ, counts),
                               **FP32)
    torch.testing.assert_close(ragged_mm(a_NK, b_LKJ, filled, "triton"), ragged_mm(a_NK, b_LKJ, filled), **FP32)
    expected_LKJ = torch.stack([a.t() @ g for a, g in zip(a_NK.split(counts), g_NJ.split(counts), strict=True)])
    grad_LKJ = ragged_weight_grad(a_NK, g_NJ, filled, "triton")
    torch.testing.assert_close(grad_LKJ, expected_LKJ, **FP32)
    torch.testing.assert_close(ragged_weight_grad(a_NK, g_NJ, filled), expected_LKJ, **FP32)
    assert all(grad_LKJ[expert].abs().sum() == 0 for expert, count in enumerate(counts) if count == 0)


def test_grouped_gemm_in_bf16() -> None:
    counts = [17, 0, 40]
    generator = torch.Generator().manual_seed(3)
    a_NK = torch.randn(57, 64, generator=generator).bfloat16()
    b_LKJ = torch.randn(3, 64, 48, generator=generator).bfloat16()
    a_NK, b_LKJ = on_device(a_NK, b_LKJ)
    filled = FilledRows.of_experts(torch.repeat_interleave(torch.arange(3), torch.tensor(counts)), 3)
    expected = _loop_reference(a_NK.float(), b_LKJ.float(), counts)  # the exact products of the bf16 inputs
    torch.testing.assert_close(ragged_mm(a_NK, b_LKJ, filled, "triton").float(), expected,
                               **bf16_tolerance(64))


def test_backend_choice() -> None:
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"  # the interpreter is for tests, not speed
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="kernel_backend='cuda' is unknown"):
        resolve_backend("cuda", torch.device("cpu"))


def test_triton_requested_without_triton_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install 'moeflow\\[triton\\]'"):
        resolve_backend("triton", torch.device("cpu"))
