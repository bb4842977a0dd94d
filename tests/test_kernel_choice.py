"""kernel_backend="auto": a measured choice per kernel, device and dtype (moeflow.kernels.choice).

The CUDA branch is exercised with a stand-in measurement and device name (CI has no GPU); the
measurement itself runs on CPU tensors, where the same code times torch's kernels.
"""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.kernels import choice as choice_module
from moeflow.kernels.choice import (
    GEMM_BACKENDS,
    KernelChoice,
    KernelTable,
    ProbeShape,
    candidates,
    grouped_mm_works,
    measure_choice,
    share_kernel_table,
)
from moeflow.kernels.ragged import FilledRows, looped_mm, ragged_mm, ragged_weight_grad
from moeflow.models.transformer import MoETransformer, TransformerConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TINY = ProbeShape(tokens=128, model_dim=32, hidden_dim=32, num_experts=8, top_k=2, repeats=2)


class FakeMeasure:
    """Counts measurements and answers a fixed choice."""

    def __init__(self, gemm: str = "grouped_mm") -> None:
        self.calls: list[tuple[str, torch.dtype]] = []
        self.gemm = gemm

    def __call__(self, device: torch.device, dtype: torch.dtype) -> KernelChoice:
        self.calls.append((device.type, dtype))
        return KernelChoice("torch", "triton", self.gemm, choice_module.MEASURED)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choice_module, "device_name", lambda device: "NVIDIA H200")


def test_auto_on_cpu_measures_nothing_and_runs_torch() -> None:
    measure = FakeMeasure()
    choice = KernelTable(measure).resolve("auto", CPU, torch.float32)
    assert (choice.encode, choice.decode, choice.gemm, choice.source) == ("torch", "torch", "torch", "host")
    assert measure.calls == []


def test_explicit_backends_run_everywhere_unmeasured(fake_gpu: None) -> None:
    measure = FakeMeasure()
    table = KernelTable(measure)
    assert table.resolve("torch", CUDA, torch.bfloat16) == KernelChoice.uniform("torch")
    assert table.resolve("triton", CPU, torch.float32).as_dict() == {
        "encode": "triton", "decode": "triton", "gemm": "triton", "source": "fixed"}
    assert measure.calls == []


def test_auto_on_cuda_measures_once_per_device_name_and_dtype(fake_gpu: None) -> None:
    measure = FakeMeasure()
    table = KernelTable(measure)
    first = table.resolve("auto", CUDA, torch.bfloat16)
    again = table.resolve("auto", torch.device("cuda", 1), torch.bfloat16)  # another GPU of the same name
    table.resolve("auto", CUDA, torch.float32)
    assert first is again and first.as_dict() == {"encode": "torch", "decode": "triton", "gemm": "grouped_mm",
                                                   "source": "measured"}
    assert measure.calls == [("cuda", torch.bfloat16), ("cuda", torch.float32)]
    assert set(table.choices) == {("NVIDIA H200", "bfloat16"), ("NVIDIA H200", "float32")}


def test_a_mistyped_backend_names_the_setting() -> None:
    with pytest.raises(ValueError, match="kernel_backend='trition' is unknown"):
        KernelTable(FakeMeasure()).resolve("trition", CPU, torch.float32)


def test_the_measurement_keeps_the_fastest_of_each_kernel_it_timed() -> None:
    choice = measure_choice(CPU, torch.float32, TINY)
    dispatch, gemms = candidates(CPU, torch.float32)
    assert choice.source == "measured" and dispatch == ["torch", "gather"] and set(gemms) <= set(GEMM_BACKENDS)
    assert set(choice.timings_ms) == {f"{k}.{b}" for k in ("encode", "decode") for b in dispatch} | {
        f"gemm.{b}" for b in gemms}
    fastest = min(gemms, key=lambda backend: choice.timings_ms[f"gemm.{backend}"])
    assert choice.gemm == fastest and {choice.encode, choice.decode} <= {"torch", "gather"}


def test_each_probe_sample_queues_several_steps_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample times ``queued`` steps in a row, so that on CUDA the host's launches count where
    they outlast the device's work (one step alone times the device only)."""
    import moeflow.timing.measure as measure

    calls: list[int] = []
    real_running = choice_module._running

    def counting(fns):  # type: ignore[no-untyped-def]
        kept = real_running(fns)
        step = kept["decode.torch"]
        kept["decode.torch"] = lambda: calls.append(1) or step()
        return kept

    def one_sample(fns, device, repeats, warmup=1, before_each=None):  # type: ignore[no-untyped-def]
        calls.clear()
        fns["decode.torch"]()
        assert len(calls) == TINY.queued == 4
        return {name: 1.0 for name in fns}

    monkeypatch.setattr(choice_module, "_running", counting)
    monkeypatch.setattr(measure, "device_medians", one_sample)
    assert measure_choice(CPU, torch.float32, TINY).source == "measured"


def test_grouped_mm_backend_equals_the_loop_with_an_empty_expert() -> None:
    if not grouped_mm_works(CPU, torch.float32):
        pytest.skip("this torch has no CPU grouped GEMM")
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 11, 3])
    rows = FilledRows.counted(torch.arange(19), counts)
    a_NK, g_NJ = torch.randn(19, 16, generator=generator), torch.randn(19, 8, generator=generator)
    b_LKJ = torch.randn(4, 16, 8, generator=generator)
    torch.testing.assert_close(ragged_mm(a_NK, b_LKJ, rows, "grouped_mm"), looped_mm(a_NK, b_LKJ, rows))
    grad = ragged_weight_grad(a_NK, g_NJ, rows, "grouped_mm")
    torch.testing.assert_close(grad, ragged_weight_grad(a_NK, g_NJ, rows, "torch"))
    assert bool((grad[1] == 0).all())


def test_last_stats_name_the_kernels_that_ran() -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, top_k=2, capacity_factor=1.0)
    layer(torch.randn(10, 16))
    assert layer.last_stats.plan.kernels == {"encode": "torch", "decode": "torch", "gemm": "torch", "source": "host"}
    with torch.no_grad():
        layer(torch.randn(1, 16))  # the direct path
    assert layer.last_stats.plan.source == "direct" and layer.last_stats.plan.kernels["source"] == "host"


def test_a_models_layers_share_one_table(fake_gpu: None) -> None:
    model = MoETransformer(TransformerConfig.build(vocab_size=32, model_dim=16, hidden_dim=16, num_experts=4, top_k=1,
                                                   layers=3, heads=2, context=8))
    tables = {id(layer.kernel_table) for layer in model.moe_layers()}
    assert len(tables) == 1
    measure = FakeMeasure()
    shared = share_kernel_table(model.moe_layers())
    shared.measure = measure
    for layer in model.moe_layers():
        layer.kernel_table.resolve("auto", CUDA, torch.bfloat16)
    assert len(measure.calls) == 1


class FixedTable:
    """A layer's kernel table that answers one choice on any device (the CPU stands in for a GPU)."""

    def __init__(self, choice: KernelChoice) -> None:
        self.choice = choice

    def resolve(self, setting: str, device: torch.device, dtype: torch.dtype) -> KernelChoice:
        return self.choice


@pytest.mark.parametrize("packed", [False, True])
def test_the_gathered_bags_equal_the_torch_kernels_forward_and_backward(packed: bool) -> None:
    from moeflow.core.routing import assign_slots
    from moeflow.kernels.slot_gather import decode, encode, make_packed_slot_map, make_slot_map

    generator = torch.Generator().manual_seed(5)
    x_TM, upstream_TM = torch.randn(2, 40, 12, generator=generator).unbind(0)
    expert_idx_TK = torch.rand(40, 6, generator=generator).topk(3, dim=1).indices
    weights_TK = torch.rand(40, 3, generator=generator)
    location_TK, counts_E = assign_slots(expert_idx_TK, 6)
    capacity = 14  # drops some choices
    plan = (make_packed_slot_map(expert_idx_TK, location_TK, counts_E, capacity) if packed
            else make_slot_map(expert_idx_TK, location_TK, 6, capacity))
    assert not bool(plan.choice_mask_TK.all())
    results = {}
    for backend in ("torch", "gather"):
        x, weights = x_TM.clone().requires_grad_(), weights_TK.clone().requires_grad_()
        buffer = encode(x, plan, backend=backend)
        scaled = buffer * torch.linspace(0.5, 2.0, buffer.shape[-1])  # a differentiable expert stand-in
        y = decode(scaled, weights, plan, backend=backend)
        (y * upstream_TM).sum().backward()
        results[backend] = (buffer.detach(), y.detach(), x.grad, weights.grad)
    for torch_value, gathered in zip(results["torch"], results["gather"], strict=True):
        torch.testing.assert_close(gathered, torch_value, rtol=1e-6, atol=1e-6)
    assert bool((results["gather"][3][~plan.choice_mask_TK] == 0).all())  # a dropped choice gets no gradient


@pytest.mark.parametrize("encode_decode", ["gather", "torch"])
def test_the_packed_path_with_each_measured_choice_equals_the_reference(encode_decode: str) -> None:
    from moeflow.reference import ReferenceMoE

    torch.manual_seed(0)
    reference = ReferenceMoE(16, 24, 8, top_k=3, capacity_factor=1.0, activation="swiglu")
    layer = MoELayer(16, 24, 8, top_k=3, capacity_factor=1.0, activation="swiglu", expert_kernel="ragged")
    layer.load_full_state_dict(reference.state_dict())
    gemm = "grouped_mm" if grouped_mm_works(CPU, torch.float32) else "torch"
    layer.kernel_table = FixedTable(KernelChoice(encode_decode, encode_decode, gemm, "measured"))
    x, upstream = torch.randn(45, 16), torch.randn(45, 16)
    outputs = []
    for module in (layer, reference):
        leaf = x.clone().requires_grad_()
        ((module(leaf) * upstream).sum() + module.aux_loss).backward()
        outputs.append([module(x).detach(), leaf.grad] + [p.grad for _, p in sorted(module.named_parameters())])
    assert layer.last_stats.plan.kernels["encode"] == encode_decode and layer.last_stats.dropped > 0
    for ours, expected in zip(*outputs, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_measurement_runs_under_a_callers_no_grad_or_inference_mode(mode: str) -> None:
    """A layer's first forward may be an evaluation: the probe's own backward must still run."""
    with getattr(torch, mode)():
        choice = measure_choice(CPU, torch.float32, TINY)
    assert choice.source == "measured" and choice.timings_ms


def test_a_candidate_that_fails_is_left_out_and_torch_must_run() -> None:
    def broken() -> None:
        raise RuntimeError("a kernel that does not compile")

    kept = choice_module._running({"encode.torch": lambda: None, "encode.triton": broken})
    assert list(kept) == ["encode.torch"]
    with pytest.raises(RuntimeError, match="does not compile"):
        choice_module._running({"encode.torch": broken})
