"""``moeflow bench overlap``: the pipeline's overlap of a transfer with the expert chunks, on one device.

With no peer to exchange with, the dispatch and combine are simulated by an exchange that moves each
chunk out and back (:class:`CopyRoute`): on CUDA through pinned host memory on the communication
stream (a device-host round trip of the dispatch size, over PCIe), on a CPU through a second buffer
on the communication worker thread. In one run, side by side (round-robin, medians), the forward
of the pipelined experts at each degree, the experts alone (t_comp) and the transfers alone
(t_copy); perfect overlap is max(t_comp, t_copy), no overlap is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moeflow.bench import record_fields
from moeflow.comm.groups import ParallelGroups
from moeflow.core.experts import FFNCompute, FFNWeights
from moeflow.kernels.precision import DTYPES
from moeflow.parallel.chunk_pipeline import ExpertExchange, pipelined_experts
from moeflow.perf.schedule_models import LOCAL
from moeflow.progress import Progress, Quiet
from moeflow.timing.measure import device_medians


@dataclass
class CopyExchange:
    """A communicating exchange whose transfer is a copy out of the device and back (its own adjoint)."""

    groups: ParallelGroups
    communicates: bool = True
    _staging: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def _round_trip(self, chunk: torch.Tensor) -> torch.Tensor:
        chunk = chunk.contiguous()
        if not chunk.is_cuda:
            return chunk.clone()
        shape = tuple(chunk.shape)
        if shape not in self._staging:  # one pinned buffer per shape: the stream orders its reuse
            self._staging[shape] = torch.empty(shape, dtype=chunk.dtype, pin_memory=True)
        host = self._staging[shape].copy_(chunk, non_blocking=True)
        return torch.empty_like(chunk).copy_(host, non_blocking=True)

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        return self._round_trip(chunk_ECM)

    def from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        return self._round_trip(y_LXM)

    def adjoint(self) -> CopyExchange:
        return self

    def chunk(self, start: int, stop: int) -> CopyExchange:
        return self


@dataclass(frozen=True)
class OverlapBenchConfig:
    """What one run measures; the defaults are the command line's (``moeflow bench overlap``)."""

    num_experts: int  # all local: no peer
    capacity: int
    model_dim: int
    hidden_dim: int
    degrees: tuple[int, ...]
    device: str
    dtype: str
    repeats: int
    warmup: int = 1


def measure_overlap(config: OverlapBenchConfig, progress: Progress | None = None) -> list[dict[str, Any]]:
    """One record per degree: the pipelined forward against t_comp, t_copy and their max and sum;
    ``progress`` counts the timed samples (each degree, t_comp and t_copy, round-robin, warm-up
    rounds included)."""
    from moeflow.bench.kernels import counting_samples

    c, e = config, config.num_experts
    device, dtype = torch.device(c.device), DTYPES[c.dtype]
    torch.manual_seed(0)
    weights = FFNWeights(*(torch.randn(shape, device=device, dtype=dtype) * 0.02 for shape in (
        (e, c.model_dim, c.hidden_dim), (e, c.hidden_dim), (e, c.hidden_dim, c.model_dim), (e, c.model_dim))))
    buffer = torch.randn(e, c.capacity, c.model_dim, device=device, dtype=dtype)
    groups = ParallelGroups.single_process()
    chunk_exchange, compute = CopyExchange(groups), FFNCompute()
    local = ExpertExchange(None, LOCAL, e)
    fns = {
        "comp": lambda: pipelined_experts(buffer, compute, weights, local, 1),
        "copy": lambda: chunk_exchange.from_experts(chunk_exchange.to_experts(buffer), c.capacity),
        **{f"d{d}": lambda d=d: pipelined_experts(buffer, compute, weights, chunk_exchange, d) for d in c.degrees},
    }
    progress = progress or Quiet()
    with torch.no_grad():
        count = counting_samples(progress, len(fns), c.warmup + c.repeats)
        medians = device_medians(fns, device, c.repeats, c.warmup, before_each=count)
        progress.advance()
    comp, copy = medians["comp"], medians["copy"]
    base = {"bench": "overlap", **record_fields(c)}
    return [{**base, "degree": d, "pipelined_ms": medians[f"d{d}"] * 1e3, "comp_ms": comp * 1e3,
             "copy_ms": copy * 1e3, "ideal_ms": max(comp, copy) * 1e3, "serial_ms": (comp + copy) * 1e3,
             "ratio_to_ideal": medians[f"d{d}"] / max(comp, copy),
             "hidden_share": (comp + copy - medians[f"d{d}"]) / min(comp, copy)} for d in c.degrees]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(records, key=lambda r: r["pipelined_ms"])
    return {"summary": "overlap", "device": best["device"], "best_degree": best["degree"],
            "best_ratio_to_ideal": round(best["ratio_to_ideal"], 3),
            "best_hidden_share": round(best["hidden_share"], 3),
            "comp_ms": round(best["comp_ms"], 3), "copy_ms": round(best["copy_ms"], 3)}
