"""The measured kernel choice and the kept-rows path on a GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.experts import ExpertFFN
from moeflow.kernels import triton_installed
from moeflow.kernels.choice import candidates, grouped_mm_works, measure_choice
from moeflow.kernels.ragged import FilledRows, looped_mm, ragged_mm, ragged_weight_grad
from moeflow.parallel.dispatchers.kept_rows import _KeptRowsExperts
from moeflow.parallel.dispatchers.stats import SOURCE
from moeflow.reference import ReferenceMoE

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
GPU = torch.device("cuda")


def _gemm_backends(dtype: torch.dtype) -> list[str]:
    return candidates(GPU, dtype)[1]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gemm_backend_equals_the_loop_on_uneven_rows(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([37, 0, 1, 250, 9])
    rows = FilledRows.counted(torch.arange(int(counts.sum())), counts)
    a_NK = torch.randn(int(counts.sum()), 64, generator=generator).to(GPU, dtype)
    g_NJ = torch.randn(int(counts.sum()), 96, generator=generator).to(GPU, dtype)
    b_LKJ = torch.randn(5, 64, 96, generator=generator).to(GPU, dtype)
    tolerance = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    expected_y, expected_w = looped_mm(a_NK, b_LKJ, rows), ragged_weight_grad(a_NK, g_NJ, rows, "torch")
    for backend in _gemm_backends(dtype):
        torch.testing.assert_close(ragged_mm(a_NK, b_LKJ, rows, backend).float(), expected_y.float(), **tolerance,
                                   msg=backend)
        grad = ragged_weight_grad(a_NK, g_NJ, rows, backend)
        torch.testing.assert_close(grad.float(), expected_w.float(), **tolerance, msg=backend)
        assert bool((grad[1] == 0).all()), backend


@cuda
def test_grouped_mm_runs_in_bf16_on_this_gpu() -> None:
    """The H200's torch has a grouped GEMM for bf16 (the record's 0.71 of peak): if this fails, auto
    silently loses its fastest GEMM."""
    assert grouped_mm_works(GPU, torch.bfloat16)


@cuda
def test_auto_measures_once_and_reports_its_choice() -> None:
    choice = measure_choice(GPU, torch.bfloat16)
    dispatch, gemms = candidates(GPU, torch.bfloat16)
    assert choice.source == "measured" and choice.encode in dispatch and choice.gemm in gemms
    assert len(choice.timings_ms) == 2 * len(dispatch) + len(gemms)
    torch.manual_seed(0)
    layer = MoELayer(64, 128, 8, top_k=2, expert_kernel="ragged").to(GPU, torch.bfloat16)
    layer(torch.randn(32, 64, device=GPU, dtype=torch.bfloat16))
    stats = layer.last_stats.plan.kernels
    assert stats["source"] == "measured" and set(layer.kernel_table.choices) == {
        (torch.cuda.get_device_name(GPU), "bfloat16")}


def _check_against_reference(kernel_backend: str, **settings) -> None:
    torch.manual_seed(0)
    reference = ReferenceMoE(32, 48, 8, **settings)
    layer = MoELayer(32, 48, 8, expert_kernel="ragged", kernel_backend=kernel_backend, **settings).cuda()
    layer.load_state_dict(reference.state_dict())
    x, upstream = torch.randn(64, 32), torch.randn(64, 32)
    x_cpu, x_gpu = x.clone().requires_grad_(), x.cuda().requires_grad_()
    expected = reference(x_cpu)
    ((expected * upstream).sum() + reference.aux_loss).backward()
    y = layer(x_gpu)
    ((y * upstream.cuda()).sum() + layer.aux_loss).backward()
    assert layer.last_stats.plan.source == SOURCE
    torch.testing.assert_close(y.detach().cpu(), expected.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x_gpu.grad.cpu(), x_cpu.grad, rtol=1e-4, atol=1e-4)
    for name, param in layer.named_parameters():
        expected_grad = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(param.grad.cpu(), expected_grad, rtol=1e-4, atol=1e-4, msg=name)
    assert layer.last_stats.dropped_per_expert == reference.dropped_per_expert


@cuda
@pytest.mark.parametrize("kernel_backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("settings", [{"capacity_factor": 1.0, "top_k": 3},
                                      {"capacity_factor": 0.0, "activation": "swiglu", "bias": False}])
def test_packed_path_on_cuda_matches_the_reference(kernel_backend: str, settings: dict) -> None:
    if kernel_backend == "triton" and not triton_installed():
        pytest.skip("no triton")
    _check_against_reference(kernel_backend, **settings)


@cuda
@pytest.mark.parametrize("backend", ["torch", "grouped_mm", "triton"])
def test_packed_experts_never_stall_the_host(backend: str) -> None:
    """The packed experts' forward and backward (biases included) queue their work with no host sync,
    in bf16 (torch's grouped GEMM in fp32 on CUDA is a host loop that syncs: not a candidate there)."""
    if backend not in _gemm_backends(torch.bfloat16):
        pytest.skip(f"{backend} does not run here in bf16")
    torch.manual_seed(0)
    experts = ExpertFFN(4, 64, 96, "swiglu").to(GPU, torch.bfloat16)
    counts = torch.tensor([5, 0, 20, 9])
    rows = FilledRows.counted(torch.arange(34), counts)
    x_NM = torch.randn(34, 64, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    weights = experts.weights().as_tuple()
    (_KeptRowsExperts.apply(x_NM, rows, experts.compute, backend, *weights).sum()).backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y_NM = _KeptRowsExperts.apply(x_NM, rows, experts.compute, backend, *weights)
        y_NM.backward(torch.ones_like(y_NM))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert experts.w1.grad is not None and experts.b1.grad is not None
