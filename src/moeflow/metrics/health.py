"""The figures of one MoE layer's step, computed from its counts: the formulas live here once (the
monitor, the tests and the report read them from here; max over mean is
:func:`moeflow.core.stats.max_over_mean`, the statistics' own), and the records the sinks write."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


def load_coefficient_of_variation(tokens_per_expert: Sequence[int]) -> float:
    """The load's standard deviation over its mean (population; 0 balanced or empty)."""
    count = len(tokens_per_expert)
    mean = sum(tokens_per_expert) / count if count else 0.0
    if not mean:
        return 0.0
    variance = sum((load - mean) ** 2 for load in tokens_per_expert) / count
    return math.sqrt(variance) / mean


def busiest_share(tokens_per_expert: Sequence[int]) -> float:
    """The busiest expert's share of the layer's assignments (1 / E balanced, 1.0 collapsed)."""
    total = sum(tokens_per_expert)
    return max(tokens_per_expert) / total if total else 0.0


def dropped_share(dropped: int, assignments: int) -> float:
    """The share of the step's assignments beyond capacity (they contribute nothing to the output)."""
    return dropped / assignments if assignments else 0.0


def router_entropy_sum(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """The summed per-token entropy (nats) of the router's distribution over the experts: softmax of
    the logits, or the sigmoid scores normalised to sum to 1 (DeepSeek-V3's router). log(E) is the
    uniform router's, 0 a router that always picks one expert. Kept on the device (no host sync)."""
    logits = logits_TE.detach().float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
        log_probs = probs.clamp_min(torch.finfo(probs.dtype).tiny).log()
    else:
        log_probs = torch.log_softmax(logits, dim=-1)
        probs = log_probs.exp()
    return -(probs * log_probs).sum()


@dataclass(frozen=True)
class LayerHealth:
    """One MoE layer's step, over every rank's tokens (``group`` of the monitor). Counts are of
    assignments (a top-k token makes k). ``router_entropy`` is the mean per-token entropy in nats
    (None: no router forward seen); ``alltoall_share`` the layer's communication that expert compute
    did not hide, as a share of the step (0 on one process; None: no step time, or not measured)."""

    block: int
    tokens_per_expert: list[int]
    load_max_over_mean: float
    load_cv: float
    busiest_share: float
    dead_experts: list[int]
    dropped: int
    dropped_share: float
    router_entropy: float | None
    bias_min: float
    bias_max: float
    schedule: str | None
    pipeline_degree: int | None
    alltoall: str | None
    token_exchange: str | None
    bytes_sent: int
    alltoall_s: float | None  # None: not measured (moeflow's transformers backend)
    alltoall_share: float | None

    def scalars(self) -> dict[str, float]:
        """The figures a chart draws (TensorBoard, CSV), under ``moe/block<N>/``."""
        values = {"load_max_over_mean": self.load_max_over_mean, "load_cv": self.load_cv,
                  "busiest_share": self.busiest_share, "dead_experts": float(len(self.dead_experts)),
                  "dropped_share": self.dropped_share, "bias_min": self.bias_min, "bias_max": self.bias_max,
                  "bytes_sent": float(self.bytes_sent), "pipeline_degree": float(self.pipeline_degree or 0)}
        if self.router_entropy is not None:
            values["router_entropy"] = self.router_entropy
        if self.alltoall_share is not None:
            values["alltoall_share"] = self.alltoall_share
        return {f"moe/block{self.block}/{name}": value for name, value in values.items()}


@dataclass(frozen=True)
class StepHealth:
    """Every MoE layer's health at one step, the step's seconds, the all-to-all's share of it (all
    layers) and the alerts that fired first at this step."""

    step: int
    step_s: float | None
    layers: list[LayerHealth]
    alerts: list[Any] = field(default_factory=list)  # moeflow.metrics.alerts.Alert

    @property
    def alltoall_share(self) -> float | None:
        measured = [layer.alltoall_s for layer in self.layers if layer.alltoall_s is not None]
        if not self.step_s or not measured:
            return None
        return sum(measured) / self.step_s

    def record(self) -> dict[str, Any]:
        """The JSON record (``metrics.jsonl``'s ``health``; a user's JSONL sink's line)."""
        return {"step": self.step, "step_s": self.step_s, "alltoall_share": self.alltoall_share,
                "layers": [asdict(layer) for layer in self.layers],
                "alerts": [alert.record() for alert in self.alerts]}

    def scalars(self) -> dict[str, float]:
        """Every layer's scalars and the step's all-to-all share, flat (a chart's tags, a CSV's columns)."""
        values: dict[str, float] = {}
        if self.alltoall_share is not None:
            values["moe/alltoall_share"] = self.alltoall_share
        for layer in self.layers:
            values.update(layer.scalars())
        return values

    def loads(self) -> dict[str, list[int]]:
        """Per layer, the assignments per expert (TensorBoard's histograms)."""
        return {f"moe/block{layer.block}/load": layer.tokens_per_expert for layer in self.layers}
