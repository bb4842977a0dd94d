"""What the MoE monitor costs a training step: the default run's model, its forward and backward
with the monitor's hooks and its step (:meth:`~moeflow.metrics.MoEMonitor.observe`) against the same
step without them, interleaved in one process on one intra-op thread, medians of each."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from moeflow.metrics import MoEMonitor
from moeflow.models import MoETransformer
from moeflow.training.config import TrainConfig


def _step_seconds(model: MoETransformer, tokens: torch.Tensor, after: Callable[[], object] | None = None) -> float:
    began = time.perf_counter()
    _, loss = model(tokens, tokens)
    loss.backward()
    if after is not None:
        after()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def run(repeats: int, warmup: int = 3, config: TrainConfig | None = None) -> dict[str, Any]:
    """One JSON line per pair of steps, then the summary (returned): the medians and the overhead."""
    torch.set_num_threads(1)  # one worker's thread, as the trainer pins it
    config = config or TrainConfig()
    model = MoETransformer(config.model_config(config.vocab_size), seed=config.seed)
    tokens = torch.randint(0, config.vocab_size, (config.batch_size, config.context),
                           generator=torch.Generator().manual_seed(config.seed))
    for _ in range(warmup):
        _step_seconds(model, tokens)
    plain, watched, observed = [], [], []
    for repeat in range(repeats):
        plain.append(_step_seconds(model, tokens))
        monitor = MoEMonitor(model, use_default_group=False)
        observe_s: list[float] = []

        def observe(monitor: MoEMonitor = monitor, observe_s: list[float] = observe_s) -> None:
            began = time.perf_counter()
            monitor.observe()
            observe_s.append(time.perf_counter() - began)

        watched.append(_step_seconds(model, tokens, observe))
        monitor.close()
        observed.append(observe_s[0])
        print(json.dumps({"repeat": repeat, "plain_step_s": plain[-1], "monitored_step_s": watched[-1],
                          "observe_s": observed[-1]}), flush=True)
    summary = {"summary": "bench monitor", "repeats": repeats, "plain_step_s": statistics.median(plain),
               "monitored_step_s": statistics.median(watched), "observe_s": statistics.median(observed)}
    summary["overhead"] = summary["monitored_step_s"] / summary["plain_step_s"] - 1
    summary["observe_share"] = summary["observe_s"] / summary["plain_step_s"]
    print(json.dumps(summary), flush=True)
    return summary
