"""``moeflow bench kernels``: encode/decode and the ragged grouped GEMM against the device's limits.

In one run, side by side (round-robin, medians): a large matmul in the benchmark's dtype (the
device's measured compute peak) and a large copy (its measured memory bandwidth); then for each
backend that runs here, encode and decode forward (GB/s: the rows they read and write) and the
grouped GEMM of the local experts on ragged per-expert row counts (TFLOP/s): ``torch`` (on CPU
torch's grouped GEMM, elsewhere a loop of ``mm``), ``grouped_mm`` (``torch._grouped_mm`` where
it runs on the device and dtype), ``triton``, and a plain loop of ``mm`` (``loop``). Each figure
is also given as a share of the measured peak. On CUDA it also reports what
``kernel_backend="auto"`` picks (:mod:`moeflow.kernels.choice`, measured at its own probe shape)
and whether that is the fastest here. CUDA timings synchronize before and after each sample. On a
CPU the Triton kernels run only under the interpreter, so they are timed only on CUDA.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moeflow.bench import record_fields
from moeflow.core.routing import assign_slots, expert_capacity
from moeflow.core.workspace import Workspace
from moeflow.kernels.choice import KernelTable, candidates
from moeflow.kernels.precision import DTYPES
from moeflow.kernels.ragged import FilledRows, looped_mm, ragged_mm
from moeflow.kernels.slot_gather import decode, encode, make_slot_map
from moeflow.progress import Progress, Quiet
from moeflow.timing.measure import device_medians

AUTO_KERNELS = {"encode": "encode", "decode": "decode", "grouped_gemm": "gemm"}  # bench kernel -> KernelChoice field
ENCODE_DECODE_TARGET = 0.70  # of the measured memory bandwidth, for large token counts (GPU)


@dataclass(frozen=True)
class KernelBenchConfig:
    """What one run measures; the defaults are the command line's (``moeflow bench kernels``)."""

    tokens: int
    model_dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    device: str
    dtype: str
    matmul_size: int
    copy_mb: int
    repeats: int
    warmup: int = 1


def _routing(config: KernelBenchConfig, device: torch.device) -> tuple[Any, torch.Tensor]:
    """Uniform random top-k routing of every token, dropless: the dispatch plan and tokens per expert."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(config.tokens, config.num_experts, generator=generator)
    expert_idx_TK = scores.topk(config.top_k, dim=1).indices
    location_TK, counts_E = assign_slots(expert_idx_TK, config.num_experts)
    capacity = expert_capacity(0.0, config.top_k, config.tokens, config.num_experts, int(counts_E.max()))
    plan = make_slot_map(expert_idx_TK.to(device), location_TK.to(device), config.num_experts, capacity)
    return plan, counts_E


def counting_samples(progress: Progress, fns: int, rounds: int) -> Callable[[], None]:
    """A ``before_each`` for :func:`device_medians` that counts its ``fns`` x ``rounds`` samples on
    ``progress`` (untimed): each call but the first marks the sample before it done; the caller
    advances the last when the medians return."""
    progress.expect(fns * rounds)
    calls = [0]

    def before_each() -> None:
        if calls[0]:
            progress.advance()
        calls[0] += 1

    return before_each


def measure_kernels(config: KernelBenchConfig, progress: Progress | None = None) -> list[dict[str, Any]]:
    """One JSON record per measurement (peak, bandwidth, each kernel and backend); ``progress``
    counts the timed samples (every kernel and backend, round-robin, warm-up rounds included)."""
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    torch.manual_seed(0)
    size, element_bytes = config.matmul_size, torch.finfo(dtype).bits // 8
    copy_elements = config.copy_mb * (1 << 20) // element_bytes
    square_a = torch.randn(size, size, device=device, dtype=dtype)
    square_b = torch.randn(size, size, device=device, dtype=dtype)
    source, target = torch.randn(copy_elements, device=device, dtype=dtype), torch.empty(copy_elements, device=device,
                                                                                         dtype=dtype)
    plan, counts_E = _routing(config, device)
    x_TM = torch.randn(config.tokens, config.model_dim, device=device, dtype=dtype)
    weights_TK = torch.rand(config.tokens, config.top_k, device=device, dtype=dtype)
    rows = FilledRows.of_experts(torch.repeat_interleave(torch.arange(config.num_experts), counts_E).to(device),
                                 config.num_experts)
    packed_NM = torch.randn(int(counts_E.sum()), config.model_dim, device=device, dtype=dtype)
    w_EMH = torch.randn(config.num_experts, config.model_dim, config.hidden_dim, device=device, dtype=dtype) * 0.02
    fns: dict[str, Callable[[], object]] = {
        "matmul": lambda: torch.mm(square_a, square_b), "copy": lambda: target.copy_(source),
    }
    workspace = Workspace()  # the torch path's buffers, reused as in the layer

    def encode_step(backend: str) -> torch.Tensor:
        workspace.start_step()
        return encode(x_TM, plan, workspace, backend)

    dispatch_backends, gemm_backends = candidates(device, dtype)
    for backend in dispatch_backends:
        buffer = encode(x_TM, plan, backend=backend)
        fns[f"encode.{backend}"] = lambda backend=backend: encode_step(backend)
        fns[f"decode.{backend}"] = lambda backend=backend, buffer=buffer: decode(buffer, weights_TK, plan,
                                                                                 backend=backend)
    for backend in gemm_backends:
        fns[f"grouped_gemm.{backend}"] = lambda backend=backend: ragged_mm(packed_NM, w_EMH, rows, backend)
    fns["grouped_gemm.loop"] = lambda: looped_mm(packed_NM, w_EMH, rows)
    progress = progress or Quiet()
    count = counting_samples(progress, len(fns), config.warmup + config.repeats)
    medians = device_medians(fns, device, config.repeats, config.warmup, before_each=count)
    progress.advance()
    records = _records(config, medians, plan, int(counts_E.sum()), element_bytes)
    if device.type == "cuda":  # what kernel_backend="auto" picks here, measured at its own probe shape
        choice = KernelTable().resolve("auto", device, dtype)
        records.append({"bench": "kernels", **record_fields(config), "kernel": "auto", **choice.as_dict(),
                        "probe_ms": choice.timings_ms})
    return records


def _records(config: KernelBenchConfig, medians: dict[str, float], plan: Any, assignments: int,
             element_bytes: int) -> list[dict[str, Any]]:
    base = {"bench": "kernels", **record_fields(config)}
    peak_flops = 2 * config.matmul_size**3 / medians["matmul"]
    bandwidth = 2 * config.copy_mb * (1 << 20) / medians["copy"]  # read and write
    row_bytes = config.model_dim * element_bytes
    moved = {  # encode: read the kept rows, write every slot; decode: read the kept rows, write every token
        "encode": (assignments + plan.num_slots) * row_bytes, "decode": (assignments + config.tokens) * row_bytes,
    }
    records = [{**base, "kernel": "matmul", "tflops": peak_flops / 1e12, "ms": medians["matmul"] * 1e3},
               {**base, "kernel": "copy", "gb_per_s": bandwidth / 1e9, "ms": medians["copy"] * 1e3}]
    gemm_flops = 2 * assignments * config.model_dim * config.hidden_dim
    for name, seconds in medians.items():
        kernel, _, backend = name.partition(".")
        if kernel in moved:
            rate = moved[kernel] / seconds
            records.append({**base, "kernel": kernel, "backend": backend, "ms": seconds * 1e3, "gb_per_s": rate / 1e9,
                            "share_of_bandwidth": rate / bandwidth})
        elif kernel == "grouped_gemm":
            rate = gemm_flops / seconds
            records.append({**base, "kernel": kernel, "backend": backend, "ms": seconds * 1e3, "tflops": rate / 1e12,
                            "share_of_peak": rate / peak_flops})
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Best backend per kernel, and the encode/decode bandwidth target where it applies (CUDA)."""
    best: dict[str, dict[str, Any]] = {}
    auto = next((record for record in records if record["kernel"] == "auto"), None)
    for record in records:
        if "backend" not in record:
            continue
        share = record.get("share_of_bandwidth", record.get("share_of_peak", 0.0))
        if record["kernel"] not in best or share > best[record["kernel"]]["share"]:
            best[record["kernel"]] = {"backend": record["backend"], "share": round(share, 3),
                                      "ms": round(record["ms"], 3)}
    device = records[0]["device"] if records else "cpu"
    shares = [best[k]["share"] for k in ("encode", "decode") if k in best]
    return {
        "summary": "kernels", "device": device, "best": best,
        "auto": None if auto is None else {kernel: auto[key] for kernel, key in AUTO_KERNELS.items()},
        "auto_is_best": None if auto is None else all(
            best[kernel]["backend"] == auto[key] for kernel, key in AUTO_KERNELS.items() if kernel in best),
        "peak_tflops": next(r["tflops"] for r in records if r["kernel"] == "matmul"),
        "bandwidth_gb_per_s": next(r["gb_per_s"] for r in records if r["kernel"] == "copy"),
        "encode_decode_target": ENCODE_DECODE_TARGET,
        "encode_decode_target_met": min(shares) >= ENCODE_DECODE_TARGET if device.startswith("cuda") and shares
        else None,  # the target is the GPU's; a CPU run reports the shares only
        "median_share": statistics.median(shares) if shares else None,
    }
