"""GPU paths: the layer on CUDA tensors and over a one-rank NCCL group. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.experts import ExpertFFN
from moeflow.distributed import free_port
from moeflow.kernels.ragged import RaggedFFNCompute
from moeflow.moe.cuda_graph import graphed_layer
from moeflow.reference import ReferenceMoE

from equivalence import all_cases, check_cases, static_cases

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _pair(**kwargs) -> tuple[ReferenceMoE, MoELayer]:
    torch.manual_seed(0)
    reference = ReferenceMoE(32, 48, 8, **kwargs)
    layer = MoELayer(32, 48, 8, **kwargs).cuda()
    layer.load_state_dict(reference.state_dict())
    return reference, layer


def _check(reference: ReferenceMoE, layer: MoELayer) -> None:
    x = torch.randn(64, 32)
    x_gpu = x.cuda().requires_grad_()
    x_cpu = x.clone().requires_grad_()
    upstream = torch.randn(64, 32)
    expected = reference(x_cpu)  # one call each: a call may move the routing bias (expert_bias_update_rate)
    ((expected * upstream).sum() + reference.aux_loss).backward()
    y = layer(x_gpu)
    ((y * upstream.cuda()).sum() + layer.aux_loss).backward()
    # TF32 is off for fp32 matmuls by default; differences are summation order on another device.
    torch.testing.assert_close(y.detach().cpu(), expected.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x_gpu.grad.cpu(), x_cpu.grad, rtol=1e-4, atol=1e-4)
    for name, param in layer.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(param.grad.cpu(), expected, rtol=1e-4, atol=1e-4, msg=name)
    assert layer.last_stats.tokens_per_expert == reference.tokens_per_expert


@cuda
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"capacity_factor": 0.5, "gate": "cosine"}, {"activation": "swiglu", "expert_bias_update_rate": 0.1}],
)
def test_layer_on_cuda_matches_reference(kwargs: dict) -> None:
    _check(*_pair(**kwargs))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equivalence_table_on_cuda(dtype: torch.dtype) -> None:
    """The equivalence table's cases in this dtype with the layer on the GPU (Triton compiled, not
    interpreted: conftest sets TRITON_INTERPRET only without CUDA), one process."""
    cases = [case for case in all_cases("cuda") + static_cases() if case.dtype == dtype]
    count, failures = check_cases(0, 1, cases, device="cuda")
    assert count == len(cases) > 10 and not failures, "\n".join(failures[:40])


@cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ragged_experts_never_stall_the_host(backend: str) -> None:
    """A ragged chunk's forward, input gradient and weight gradients on CUDA queue their work without
    one host sync (the row indices and the Triton grid are built on the host from the exchanged
    counts, which live there): the pipeline's communication stream keeps the host free to issue."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    experts = ExpertFFN(4, 64, 96, "swiglu").cuda()
    filled_LW = torch.tensor([[5, 0], [0, 0], [17, 3], [1, 8]])  # host counts, as the layer keeps them
    compute = RaggedFFNCompute(experts.compute, filled_LW, backend=backend).chunk(0, 16)
    x_LCM, grad_LCM = torch.randn(2, 4, 32, 64, device="cuda").unbind(0)
    weights = experts.weights()
    with torch.no_grad():  # as inside the experts' autograd function
        # warm up: compile every kernel, grow the caching allocator
        warm_saved = compute.forward(x_LCM, weights)[1]
        compute.weight_grads(compute.backward_input(warm_saved, grad_LCM, weights)[1], weights)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y_LCM, saved = compute.forward(x_LCM, weights)
            grad_x_LCM, inputs = compute.backward_input(saved, grad_LCM, weights)
            grads = compute.weight_grads(inputs, weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert y_LCM.shape == grad_x_LCM.shape == x_LCM.shape and grads[0].shape == weights.w1.shape


@cuda
def test_the_default_step_on_cuda_is_static_and_never_waits_for_the_device() -> None:
    """``step_shapes="auto"`` takes the static step for a training call on a GPU: not one host wait
    in its forward and backward (capacity from the factor, the counts read only with the statistics)."""
    torch.manual_seed(0)
    layer = MoELayer(64, 96, 8, top_k=2, capacity_factor=1.0, activation="swiglu").cuda()
    x = torch.randn(256, 64, device="cuda")

    def step() -> None:
        leaf = x.detach().requires_grad_()
        ((layer(leaf) ** 2).sum() + layer.aux_loss).backward()

    step()  # the first call measures its kernels and grows the allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = layer.last_stats
    assert stats.plan.source == "static" and stats.capacity == 64 and sum(stats.tokens_per_expert) == 512


def _graphed_and_eager_step(run, layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor):  # type: ignore[no-untyped-def]
    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    y = run(leaf)
    ((y * upstream).sum() + layer.aux_loss).backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return y.detach().clone(), leaf.grad.clone(), grads, layer.last_stats


@cuda
def test_a_graphed_layer_replays_the_static_step_on_cuda() -> None:
    """Captured in CUDA graphs, the layer computes what it computes eagerly on each replay's own
    tokens (their routing, drops and aux loss), and its statistics are the replay's."""
    torch.manual_seed(0)
    layer = MoELayer(64, 96, 8, top_k=2, capacity_factor=1.0, activation="swiglu", step_shapes="static").cuda()
    eager = copy.deepcopy(layer)
    step = graphed_layer(layer, torch.randn(256, 64, device="cuda", requires_grad=True))
    generator = torch.Generator("cuda").manual_seed(1)
    loads = set()
    for _ in range(2):
        x, upstream = torch.randn(2, 256, 64, device="cuda", generator=generator).unbind(0)
        graphed_run = _graphed_and_eager_step(step, layer, x, upstream)
        eager_run = _graphed_and_eager_step(eager, eager, x, upstream)
        for got, expected in zip(graphed_run[:2], eager_run[:2], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for name, grad in graphed_run[2].items():
            torch.testing.assert_close(grad, eager_run[2][name], rtol=1e-5, atol=1e-5, msg=name)
        assert graphed_run[3].tokens_per_expert == eager_run[3].tokens_per_expert
        assert graphed_run[3].dropped == eager_run[3].dropped
        loads.add(tuple(graphed_run[3].tokens_per_expert))
    assert len(loads) == 2  # each replay's own statistics


@cuda
def test_the_dedup_combines_sum_gives_the_same_bf16_bits_twice_on_cuda() -> None:
    """The dedup and node-dedup combines sum a token's copies in a fixed order, in fp32, rounded once:
    on CUDA, where ``index_add_``'s atomic adds changed the bf16 result from run to run."""
    from moeflow.parallel.ragged_exchange import summed_rows

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(8192, 512, generator=generator).to("cuda", torch.bfloat16)
    into = torch.randint(0, 1024, (8192,), generator=generator)  # about 8 copies a token
    first, second = (summed_rows(rows, into, 1024) for _ in range(2))
    assert first.dtype == torch.bfloat16 and torch.equal(first, second)
    expected = torch.zeros(1024, 512, dtype=torch.float64).index_add_(0, into, rows.double().cpu())
    torch.testing.assert_close(first.cpu().double(), expected, rtol=2 * 2**-8, atol=1e-2)


@cuda
def test_layer_over_one_rank_nccl_group() -> None:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        reference, layer = _pair(capacity_factor=0.0)
        assert layer.world_size == 1 and layer.groups.expert is not None
        _check(reference, layer)
        assert layer.last_stats.plan.world_size == 1 and layer.last_stats.plan.alltoall == "none"
    finally:
        dist.destroy_process_group()


@cuda
@pytest.mark.parametrize("extra", [[], ["--dtype", "bf16", "--grad-sync", "lina"]])
def test_train_with_nccl_under_torchrun(tmp_path, extra: list[str]) -> None:
    """The trainer's GPU path: one NCCL rank started by torchrun, model and batches on cuda:0."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    data = Path(json.__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
         "-m", "moeflow", "train", "--backend", "nccl", "--data", str(data), "--vocab-size", "512",
         "--context", "32", "--layers", "2", "--heads", "2", "--model-dim", "32", "--hidden-dim", "64",
         "--num-experts", "4", "--batch-size", "4", "--steps", "4", "--eval-interval", "2",
         "--run-dir", str(tmp_path / "run"), "--no-progress", *extra],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MOEFLOW_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(next(line for line in result.stdout.splitlines() if line.startswith('{"summary"')))
    assert summary["steps"] == 4 and summary["workers"] == 1 and summary["val_loss"] > 0
