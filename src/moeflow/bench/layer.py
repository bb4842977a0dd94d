"""``moeflow bench layer``: MoELayer against the plain reference and against the FLOP floor.

For each configuration, in one run and side by side (round-robin, medians): forward+backward of
MoELayer and of ReferenceMoE on the same weights and tokens, the expert FFN alone with every expert
kernel, encode+decode alone (forward and backward) with the routing of the same tokens, and a large
square matmul that gives this machine's rate. The floor is the expert FFN's floating-point work for
the k*T routed tokens divided by that rate. With ``workers > 1`` every gloo worker holds T tokens,
its share of the experts, and reports its own numbers; the slowest worker is reported. Its reference
is the single-process cost of the same T tokens with all experts (what a worker would pay without
expert parallelism).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.collectives import barrier
from moeflow.config import LayerDims, ffn_projections
from moeflow.core.experts import KERNELS, ExpertFFN, ffn_flops
from moeflow.core.routing import assign_slots, expert_capacity, select_experts
from moeflow.kernels.precision import DTYPES
from moeflow.kernels.slot_gather import decode, encode, make_packed_slot_map, make_slot_map, make_static_slot_map
from moeflow.moe.cuda_graph import graphed_layer
from moeflow.moe.layer import MoELayer
from moeflow.parallel.dispatchers.static import GATHER, STATIC
from moeflow.parallel.dispatchers.stats import SOURCE
from moeflow.reference import ReferenceMoE
from moeflow.runtime import tune_cpu_allocator, tuning_requested
from moeflow.timing.measure import device_medians

DEFAULT_DIMS = LayerDims(512, 2048, 8, top_k=2)  # E=8, H=2048: the first target shape


@dataclass(frozen=True)
class LayerBenchConfig:
    """One measured configuration: the layer's shape (its projections follow ``activation``) and how
    it is timed."""

    dims: LayerDims = DEFAULT_DIMS
    tokens: int = 4096
    capacity_factor: float = 1.0
    activation: str = "gelu"
    repeats: int = 5
    warmup: int = 1
    measure_kernels: bool = True
    device: str = "cpu"
    dtype: str = "fp32"  # bf16/fp16: the layer's parameters and tokens (the router stays fp32)
    matmul_size: int = 2048  # the square matmul whose rate defines the floor
    expert_kernel: str = "bmm"  # the layer's (ragged on one process: the kept-rows path)
    step_shapes: str = "auto"  # the layer's: static on a GPU (shapes from the call, no host read), dynamic on a CPU
    cuda_graph: bool = False  # time the layer's step captured in CUDA graphs (moeflow.moe.cuda_graph)

    def __post_init__(self) -> None:
        if self.dims.projections != ffn_projections(self.activation):
            raise ValueError(f"dims.projections={self.dims.projections} but activation={self.activation!r} has "
                             f"{ffn_projections(self.activation)} projections: build the dims with that many")

    def record_fields(self) -> dict[str, Any]:
        """This configuration under the keys of the benchmark's records (flat; ``experts`` is E), which
        dated records compare against."""
        d = self.dims
        return {"tokens": self.tokens, "model_dim": d.model_dim, "hidden_dim": d.hidden_dim, "experts": d.num_experts,
                "top_k": d.top_k, "capacity_factor": self.capacity_factor, "activation": self.activation,
                "repeats": self.repeats, "warmup": self.warmup, "device": self.device, "dtype": self.dtype,
                "matmul_size": self.matmul_size, "expert_kernel": self.expert_kernel, "bias": d.bias,
                "step_shapes": self.step_shapes, "cuda_graph": self.cuda_graph}


# The two shapes of the targets: few large experts, many small ones.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((8, 2048), (64, 256))  # (num_experts, hidden_dim)
TARGETS = {  # (num_experts, hidden_dim) -> (max ratio to floor, min speedup over the reference)
    (8, 2048): (1.2, 1.0),
    (64, 256): (1.6, 5.0),
}
MAX_ENCODE_DECODE_SHARE = 0.10
GPU_TARGETS = {  # (num_experts, model_dim, hidden_dim, tokens, k) -> max ratio to the GEMM floor, bf16 on a GPU
    (8, 4096, 14336, 8192, 2): 1.2,  # Mixtral-like (issue 60)
    (64, 2048, 1408, 8192, 8): 1.3,  # Qwen-MoE-like (issue 60)
}


def _forward_backward(module: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> None:
    x = x.detach().requires_grad_()
    y = module(x)
    ((y * upstream).sum() + module.aux_loss).backward()
    module.zero_grad(set_to_none=True)


def measure_layer(rank: int, world_size: int, config: LayerBenchConfig) -> dict[str, Any]:
    """Measure one configuration on this rank (works with and without a process group)."""
    torch.manual_seed(0)
    c, d = config, config.dims
    reference = ReferenceMoE(d.model_dim, d.hidden_dim, d.num_experts, top_k=d.top_k,
                             capacity_factor=c.capacity_factor, activation=c.activation, bias=d.bias)
    # one chunk and the linear all-to-all: this benchmark measures the layer's kernels, not the
    # planner (moeflow bench pipeline does), so its trials must not mix into the medians
    layer = MoELayer(d.model_dim, d.hidden_dim, d.num_experts, top_k=d.top_k, capacity_factor=c.capacity_factor,
                     activation=c.activation, bias=d.bias, pipeline=1, alltoall="linear", expert_kernel=c.expert_kernel,
                     step_shapes=c.step_shapes)
    layer.load_full_state_dict(reference.state_dict())
    device, dtype = torch.device(c.device), DTYPES[c.dtype]
    reference, layer = reference.to(device, dtype), layer.to(device, dtype)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(c.tokens, d.model_dim, generator=generator).to(device, dtype)
    upstream = torch.randn(c.tokens, d.model_dim, generator=generator).to(device, dtype)
    distributed = world_size > 1 and dist.is_initialized()

    def sync() -> None:
        if distributed:
            barrier()

    fns: dict[str, Callable[[], object]] = {
        "moeflow": _layer_step(layer, x, upstream, c.cuda_graph),
        "reference": lambda: _forward_backward(reference, x, upstream),
    }
    layer(x)  # a training forward (the parameters need grad): its routing stats, capacity and path
    stats = layer.last_stats
    assert stats is not None and stats.plan is not None
    fns["encode_decode"] = _encode_decode_step(layer, x, upstream, c, stats.plan.source)
    if c.measure_kernels:
        expert_tokens = world_size * stats.capacity
        for kernel in KERNELS:
            fns[f"experts_{kernel}"] = _experts_step(layer, kernel, expert_tokens)
    fns["gemm_floor"] = _gemm_floor_step(layer, world_size * stats.capacity)
    size = c.matmul_size
    square_a, square_b = (torch.randn(size, size).to(device, dtype) for _ in range(2))
    fns["matmul"] = lambda: torch.mm(square_a, square_b)  # the rate, under the same noise as the rest
    medians = device_medians(fns, device, c.repeats, c.warmup, before_each=sync)
    rate = 2 * size**3 / medians["matmul"]
    floor_s = ffn_flops(d.top_k * c.tokens, d.model_dim, d.hidden_dim, c.activation, backward=True) / rate
    result: dict[str, Any] = {
        "bench": "layer",
        **c.record_fields(),
        "workers": world_size,
        "threads_per_worker": torch.get_num_threads(),
        "malloc_tuned": tune_cpu_allocator(tuning_requested(os.environ)),  # the entry point's setting
        "capacity": stats.capacity,
        "dropped": stats.dropped,
        "matmul_gflops": rate / 1e9,
        "floor_ms": floor_s * 1e3,
        "moeflow_ms": medians["moeflow"] * 1e3,
        "reference_ms": medians["reference"] * 1e3,
        "speedup_vs_reference": medians["reference"] / medians["moeflow"],
        "ratio_to_floor": medians["moeflow"] / floor_s,
        "encode_decode_ms": medians["encode_decode"] * 1e3,
        "encode_decode_share": medians["encode_decode"] / medians["moeflow"],
        "kernels": stats.plan.kernels if stats.plan is not None else {},
        "source": stats.plan.source if stats.plan is not None else None,
        "gemm_floor_ms": medians["gemm_floor"] * 1e3,
        "ratio_to_gemm_floor": medians["moeflow"] / medians["gemm_floor"],
    }
    if c.measure_kernels:
        result["expert_kernel_ms"] = {
            k: medians[f"experts_{k}"] * 1e3 for k in KERNELS
        }
    return result


def _layer_step(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor, graphed: bool) -> Callable[[], None]:
    """The layer's forward and backward, as a user runs it or (``graphed``) captured in CUDA graphs."""
    if not graphed:
        return lambda: _forward_backward(layer, x, upstream)
    step = graphed_layer(layer, x.detach().requires_grad_())

    def replay() -> None:
        y = step(x.detach().requires_grad_())
        ((y * upstream).sum() + layer.aux_loss).backward()
        layer.zero_grad(set_to_none=True)

    return replay


def _encode_decode_step(
    layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor, c: LayerBenchConfig, source: str | None = None
) -> Callable[[], None]:
    """Encode and decode alone, forward and backward, with the routing these tokens get, into the
    capacity buffer, the packed rows (the layer's kept-rows path) or a static plan (the static step)."""
    d = c.dims
    with torch.no_grad():
        choice = select_experts(layer.gate(x), d.top_k)
    location, counts = assign_slots(choice.expert_idx_TK, d.num_experts)
    counts = counts.cpu()
    capacity = expert_capacity(c.capacity_factor, d.top_k, c.tokens, d.num_experts, int(counts.max()))
    kernels = layer.kernel_table.resolve(layer.config.kernel_backend, x.device, x.dtype)
    if source == SOURCE:
        plan = make_packed_slot_map(choice.expert_idx_TK, location, counts, capacity)
    elif source == STATIC:
        plan = make_static_slot_map(choice.expert_idx_TK, location, d.num_experts, capacity)
        kernels = dataclasses.replace(kernels, encode=GATHER, decode=GATHER)
    else:
        plan = make_slot_map(choice.expert_idx_TK, location, d.num_experts, capacity)
    weights = choice.weights_TK.detach()

    def step() -> None:
        x_leaf = x.detach().requires_grad_()
        weights_leaf = weights.clone().requires_grad_()
        buffer = encode(x_leaf, plan, backend=kernels.encode)
        y = decode(buffer, weights_leaf, plan, backend=kernels.decode)
        (y * upstream).sum().backward()

    return step


def _gemm_floor_step(layer: MoELayer, tokens_per_expert: int) -> Callable[[], None]:
    """The experts' GEMMs as plain batched matmuls (forward and backward, no routing, no kernel of
    moeflow's): the floor the issue measures the layer against."""
    w = layer.experts.w1
    projections = ffn_projections(layer.config.activation)
    shapes = [(w.shape[0], w.shape[1], w.shape[2])] * (projections - 1) + [(w.shape[0], w.shape[2], w.shape[1])]
    weights = [torch.randn(shape, device=w.device, dtype=w.dtype).mul_(0.02).requires_grad_() for shape in shapes]
    x = torch.randn(w.shape[0], tokens_per_expert, w.shape[1], device=w.device, dtype=w.dtype)

    def step() -> None:
        x_leaf = x.detach().requires_grad_()
        hidden = torch.bmm(x_leaf, weights[0])
        if projections == 3:
            hidden = hidden * torch.bmm(x_leaf, weights[1])
        torch.bmm(hidden, weights[-1]).sum().backward()

    return step


def _experts_step(layer: MoELayer, kernel: str, tokens_per_expert: int) -> Callable[[], None]:
    w1 = layer.experts.w1
    experts = ExpertFFN(layer.num_local_experts, layer.config.model_dim, layer.config.hidden_dim,
                        layer.config.activation, kernel).to(w1.device, w1.dtype)
    experts.load_state_dict(layer.experts.state_dict())
    x = torch.randn(layer.num_local_experts, tokens_per_expert, layer.config.model_dim, device=w1.device,
                    dtype=w1.dtype)
    upstream = torch.randn_like(x)

    def step() -> None:
        x_leaf = x.detach().requires_grad_()
        (experts(x_leaf) * upstream).sum().backward()
        experts.zero_grad(set_to_none=True)

    return step


def slowest_worker(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The worker whose moeflow time is largest speaks for the run (everyone waits for it)."""
    return max(results, key=lambda r: r["moeflow_ms"])


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary object: the issue's targets, met or not, for the shapes that have targets."""
    checks = []
    for r in results:
        target = TARGETS.get((r["experts"], r["hidden_dim"]))
        if target is None or r["tokens"] != 4096 or r["model_dim"] != 512 or r["workers"] != 1 or r["dtype"] != "fp32":
            continue
        max_floor_ratio, min_speedup = target
        checks.append({
            "experts": r["experts"], "hidden_dim": r["hidden_dim"],
            "ratio_to_floor": round(r["ratio_to_floor"], 3), "max_ratio_to_floor": max_floor_ratio,
            "speedup_vs_reference": round(r["speedup_vs_reference"], 2), "min_speedup": min_speedup,
            "encode_decode_share": round(r["encode_decode_share"], 3),
            "met": r["ratio_to_floor"] <= max_floor_ratio and r["speedup_vs_reference"] >= min_speedup
            and r["encode_decode_share"] <= MAX_ENCODE_DECODE_SHARE,
        })
    gpu_checks = [
        {"experts": r["experts"], "model_dim": r["model_dim"], "hidden_dim": r["hidden_dim"], "tokens": r["tokens"],
         "top_k": r["top_k"], "expert_kernel": r["expert_kernel"],
         "ratio_to_gemm_floor": round(r["ratio_to_gemm_floor"], 3), "max": limit,
         "met": r["ratio_to_gemm_floor"] <= limit}
        for r in results
        if r["device"].startswith("cuda") and r["dtype"] == "bf16"
        and (limit := GPU_TARGETS.get((r["experts"], r["model_dim"], r["hidden_dim"], r["tokens"], r["top_k"])))
    ]
    return {
        "summary": "layer",
        "gpu_targets": gpu_checks,
        "configurations": len(results),
        "median_speedup_vs_reference": statistics.median(r["speedup_vs_reference"] for r in results),
        "median_ratio_to_floor": statistics.median(r["ratio_to_floor"] for r in results),
        "max_encode_decode_share": max(r["encode_decode_share"] for r in results),
        "targets": checks,
        "all_targets_met": all(check["met"] for check in checks) if checks else None,
    }
