"""Benchmark helpers around :mod:`moeflow.timing.measure`: the machine's speed probe, and layer steps."""

from __future__ import annotations

import statistics
from typing import Any

from moeflow.parallel.online_planner import DECIDED
from moeflow.timing.measure import slowest_rank_seconds


class SpeedProbe:
    """The reference expert FFN of :data:`~moeflow.perf.profile.SPEED_PROBE`, timed on every rank
    at once in each round of a benchmark: its median says how fast the machine ran during the
    measurement, so that a calibrated twin can be re-timed to it. Every rank calls :meth:`sample`."""

    def __init__(self) -> None:
        import torch

        from moeflow.core.experts import ExpertFFN
        from moeflow.perf.profile import SPEED_PROBE

        self._ffn = ExpertFFN(1, SPEED_PROBE["model_dim"], SPEED_PROBE["hidden_dim"])
        self._x = torch.randn(1, SPEED_PROBE["tokens"], SPEED_PROBE["model_dim"], requires_grad=True)
        self.samples: list[float] = []

    def _run(self) -> None:
        self._ffn(self._x).sum().backward()  # as ``moeflow calibrate`` times the FFN

    def sample(self) -> None:
        self.samples.append(slowest_rank_seconds(self._run))

    def record(self, bench: str, config: str) -> dict[str, Any]:
        return {"bench": "speed-probe", "measured_by": bench, "config": config,
                "probe_ms": statistics.median(self.samples) * 1e3}


def layer_training_step(layer: Any, x: Any) -> None:
    """One forward + backward of a layer (its output's mean square plus its aux loss), grads dropped."""
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    layer.zero_grad(set_to_none=True)


def settle_planner(layer: Any, x: Any, limit: int = 300) -> int:
    """Run training steps until the layer's planner settles on a plan (or has nothing to
    plan); the iterations it took."""
    for iteration in range(1, limit + 1):
        layer_training_step(layer, x)
        if layer.last_stats.plan.source in DECIDED:
            return iteration
    return limit


def round_robin_steps(
    layers: dict[str, Any], x: Any, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], SpeedProbe]:
    """Each layer's training steps and inference forwards (the slowest rank's seconds), one of each
    per layer per round, round-robin over ``repeats`` rounds after one that warms every layer up;
    the speed probe sampled once per round."""
    import torch

    steps: dict[str, list[float]] = {name: [] for name in layers}
    forwards: dict[str, list[float]] = {name: [] for name in layers}
    probe = SpeedProbe()
    for round_index in range(repeats + 1):
        for name, layer in layers.items():
            step = slowest_rank_seconds(lambda layer=layer: layer_training_step(layer, x))
            with torch.no_grad():
                forward = slowest_rank_seconds(lambda layer=layer: layer(x))
            if round_index:
                steps[name].append(step)
                forwards[name].append(forward)
        probe.sample()
    return steps, forwards, probe
