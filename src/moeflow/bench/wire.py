"""``moeflow bench wire``: the wire formats (``wire_dtype``) against the exact exchange on an
emulated cluster: time and error, side by side.

Per point (one expert-parallel layer, the same weights and tokens in every format): the time of
one exchange of the layer's dispatch buffer (encode, all-to-all, decode; the slowest rank's median),
the layer's training step at pipeline degree 1 (nothing hides the exchange) and the error of each
format against the exact layer: its output, the gradient of its input and of its expert weights
(the largest difference over the largest exact value, and the relative norm of the difference).
A format's exchange ratio is the exact exchange's time over its own."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from moeflow.config import WIRE_DTYPES
from moeflow.progress import Progress

EXCHANGE_GOAL = 1.6  # bf16 against exact: the time in the exchange (issue 65)


@dataclass(frozen=True)
class WirePoint:
    """One measured layer: E experts of hidden size H over the ranks, T tokens per rank of M, top-k,
    at capacity factor f (uniform routing, so the buffer is the layer's)."""

    num_experts: int = 8
    hidden_dim: int = 1024
    tokens: int = 2048
    model_dim: int = 512
    top_k: int = 2
    capacity_factor: float = 1.0

    @property
    def name(self) -> str:
        return (f"E{self.num_experts}-H{self.hidden_dim}-T{self.tokens}-M{self.model_dim}-k{self.top_k}"
                f"-f{self.capacity_factor:g}")


def _layers(point: WirePoint, groups: Any) -> dict[str, Any]:
    import torch

    from moeflow.moe.layer import MoELayer

    layers = {}
    for wire_dtype in WIRE_DTYPES:
        torch.manual_seed(0)  # the same weights in every format
        layers[wire_dtype] = MoELayer(
            point.model_dim, point.hidden_dim, point.num_experts, top_k=point.top_k,
            capacity_factor=point.capacity_factor, group=groups, pipeline=1, alltoall="linear",
            token_exchange="padded", wire_dtype=wire_dtype,
        )
    return layers


def _errors(layers: dict[str, Any], x: Any) -> dict[str, dict[str, float]]:
    """Each format's output and gradients against the exact layer's, on the same tokens."""
    import torch

    results = {}
    for wire_dtype, layer in layers.items():
        x_in = x.clone().requires_grad_(True)
        y = layer(x_in)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()  # a gradient that differs per column
        weights = [p.grad for p in layer.experts.parameters() if p.grad is not None]
        results[wire_dtype] = {"output": y.detach(), "grad_input": x_in.grad, "grad_experts": torch.cat(
            [w.flatten() for w in weights])}
        layer.zero_grad(set_to_none=True)
    exact = results["exact"]
    return {wire: {f"{name}_max_error": float((value - exact[name]).abs().max() / exact[name].abs().max())
                   for name, value in found.items()} | {
                   f"{name}_norm_error": float((value - exact[name]).norm() / exact[name].norm())
                   for name, value in found.items()} for wire, found in results.items() if wire != "exact"}


def _exchange_times(groups: Any, buffer: Any, repeats: int) -> dict[str, list[float]]:
    """The slowest rank's seconds of one exchange of ``buffer`` in each format, round-robin (the
    VM's drift reaches every format alike) after a round that warms them up."""
    from moeflow.bench.timing import slowest_rank_seconds
    from moeflow.comm.algorithms import exchange

    times: dict[str, list[float]] = {wire: [] for wire in WIRE_DTYPES}
    for round_index in range(repeats + 1):
        for wire in WIRE_DTYPES:
            seconds = slowest_rank_seconds(lambda wire=wire: exchange("linear", buffer, groups, wire_dtype=wire))
            if round_index:
                times[wire].append(seconds)
    return times


def _measure_point(point: WirePoint, groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.timing import round_robin_steps
    from moeflow.core.capacity import expert_capacity

    layers = _layers(point, groups)
    x = torch.randn(point.tokens, point.model_dim, generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    errors = _errors(layers, x)
    capacity = expert_capacity(point.capacity_factor, point.top_k, point.tokens, point.num_experts, 0)
    buffer = torch.randn(point.num_experts, capacity, point.model_dim)
    exchanged = _exchange_times(groups, buffer, repeats)
    train, _, probe = round_robin_steps(layers, x, repeats)
    if dist.get_rank() == 0:
        emit(probe.record("wire", point.name))
        exchange_s = {wire: statistics.median(times) for wire, times in exchanged.items()}
        step_s = {wire: statistics.median(times) for wire, times in train.items()}
        for wire in WIRE_DTYPES:
            emit({"bench": "wire", "config": point.name, "wire_dtype": wire, "exchange_ms": exchange_s[wire] * 1e3,
                  "train_step_ms": step_s[wire] * 1e3, "buffer_mb": buffer.nbytes / 2**20,
                  "exchange_over_exact": exchange_s["exact"] / exchange_s[wire],
                  "train_step_over_exact": step_s["exact"] / step_s[wire], **errors.get(wire, {})})


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    grid_rank_main(argv, "wire", lambda values, *rest: _measure_point(WirePoint(**values), *rest))


def run(
    grid: list[WirePoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29797, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid (no calibration: nothing here is planned), return
    rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.wire", "wire", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, calibrate=False, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each format's exchange and step ratios over exact and its largest errors, per point; the
    bf16 exchange goal (at least 1.6x less time)."""
    rows = [r for r in records if r.get("bench") == "wire" and r["wire_dtype"] != "exact"]
    if not rows:
        return {"summary": "wire", "configs": 0}
    bf16 = [r["exchange_over_exact"] for r in rows if r["wire_dtype"] == "bf16"]
    return {
        "summary": "wire", "configs": len({r["config"] for r in rows}),
        "exchange_over_exact": {f"{r['config']} {r['wire_dtype']}": round(r["exchange_over_exact"], 3) for r in rows},
        "train_step_over_exact": {f"{r['config']} {r['wire_dtype']}": round(r["train_step_over_exact"], 3)
                                  for r in rows},
        "largest_error": {f"{r['config']} {r['wire_dtype']}": max(v for k, v in r.items() if k.endswith("_max_error"))
                          for r in rows},
        "bf16_exchange_worst": min(bf16), "bf16_exchange_goal_met": min(bf16) >= EXCHANGE_GOAL,
    }


LOSS_GOAL = 0.01  # bf16 against exact: the loss at the last step (issue 65)
LOSS_WINDOW = 10  # the loss at a step: the mean over the last this many steps (one batch's is noisy)
LOSS_MODEL = {"layers": 2, "model_dim": 128, "hidden_dim": 256, "num_experts": 4, "context": 64, "batch_size": 8}
"""The model the loss curves train: small enough for 3 x 200 steps on 2 cores in minutes."""


def loss_curves(steps: int, workers: int, folder: str, emit: Any = print) -> list[dict[str, Any]]:
    """``moeflow train`` of :data:`LOSS_MODEL` for ``steps`` steps on ``workers`` local workers in
    each format, the same seed and data; one record per format: its loss at the last step (the mean
    of the last :data:`LOSS_WINDOW`) and its relative difference from the exact run's."""
    import json
    import subprocess
    from pathlib import Path

    losses = {}
    for wire_dtype in WIRE_DTYPES:
        run_dir = Path(folder) / f"loss-{wire_dtype}"
        command = [sys.executable, "-m", "moeflow", "train", "--workers", str(workers), "--steps", str(steps),
                   "--wire-dtype", wire_dtype, "--run-dir", str(run_dir),
                   *(f"--{key.replace('_', '-')}={value}" for key, value in LOSS_MODEL.items())]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"moeflow train --wire-dtype {wire_dtype} failed:\n{done.stderr[-4000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        curve = [r["loss"] for r in records if "loss" in r and "step" in r]
        losses[wire_dtype] = (statistics.fmean(curve[-LOSS_WINDOW:]), curve)
    exact = losses["exact"][0]
    out = []
    for wire_dtype, (loss, curve) in losses.items():
        record = {"bench": "wire-loss", "wire_dtype": wire_dtype, "steps": len(curve), "loss": loss,
                  "loss_over_exact": loss / exact - 1, "curve": [round(v, 5) for v in curve]}
        emit(json.dumps(record))
        out.append(record)
    return out


def summarize_losses(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each format's loss at the last step against the exact run's, and the bf16 goal (within 1 %)."""
    off = {r["wire_dtype"]: round(r["loss_over_exact"], 5) for r in records if r["wire_dtype"] != "exact"}
    return {"summary": "wire-loss", "steps": records[0]["steps"], "loss_over_exact": off,
            "bf16_loss_goal_met": abs(off["bf16"]) <= LOSS_GOAL}


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
