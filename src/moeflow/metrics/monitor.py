"""One monitor for any loop: it watches every MoE block of a model through forward hooks (a
:class:`~moeflow.MoELayer`, or a transformers block run by moeflow's expert-parallel backend:
:mod:`moeflow.metrics.blocks`) and, once per step, turns what their forwards left (``last_stats``,
the router's logits, the bytes the ledger counted) into each layer's
:class:`~moeflow.metrics.health.LayerHealth`.

Every figure covers every rank's tokens: :meth:`MoEMonitor.step` is a collective over ``group``
(one small all-reduce), so every rank calls it, at the same point of its loop.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import moeflow.metrics.health as figures
from moeflow.comm.collectives import reduce_values
from moeflow.comm.groups import default_group
from moeflow.comm.ledger import tracked
from moeflow.core.stats import PipelineTiming, max_over_mean
from moeflow.metrics.alerts import AlertState, HealthRules
from moeflow.metrics.blocks import WatchedBlock, watched_blocks
from moeflow.metrics.health import LayerHealth, StepHealth
from moeflow.metrics.sinks import MetricsSink
from moeflow.moe.forward_memory import recomputing


class MoEHealthWarning(UserWarning):
    """An alert of the monitor: the MoE is training badly (a collapsed router, dead experts, drops,
    an all-to-all that dominates the step)."""


@dataclass
class _Window:
    """What one layer's forwards left since the last step, on this rank."""

    num_experts: int
    counts: np.ndarray = field(init=False)
    dropped: int = 0
    entropy: torch.Tensor | None = None  # summed per-token entropy of the router, on the device
    routed: int = 0  # tokens the router saw on this rank
    timings: list[PipelineTiming] = field(default_factory=list)  # communicated forwards' timings
    unread: bool = False  # a forward's statistics not yet folded in

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Empty, for the next step."""
        self.counts = np.zeros(self.num_experts, dtype=np.int64)
        self.dropped, self.entropy, self.routed, self.timings, self.unread = 0, None, 0, [], False

    def fold(self, block: WatchedBlock) -> None:
        """Add the block's last forward's statistics (read now: a forward's may arrive late)."""
        self.unread = False
        stats = block.last_stats
        if stats is None:
            return
        self.counts += np.asarray(stats.tokens_per_expert, dtype=np.int64)
        self.dropped += stats.dropped
        communicated = stats.plan is not None and stats.plan.world_size > 1 and stats.plan.alltoall != "none"
        if block.timed and communicated:
            self.timings.append(stats.timing)

    def alltoall_s(self) -> float:
        """The communication the expert compute did not hide, forward and backward, over the forwards."""
        return sum(max(0.0, timing.total_s - timing.expert_total_s) for timing in self.timings)


class MoEMonitor:
    """The health of every MoE layer of ``model``, per step: ``monitor.step()`` after each optimizer
    step (every rank). ``group``: the ranks whose tokens the figures cover (default: the world when
    torch.distributed is initialized); ``sinks`` write each step (give them on one rank);
    ``warn``: alerts also go to the log, once each (default: on the group's rank 0)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None, rules: HealthRules | None = None,
                 sinks: Sequence[MetricsSink] = (), warn: bool | None = None, use_default_group: bool = True) -> None:
        self.layers = watched_blocks(model)
        if not self.layers:
            raise ValueError("MoEMonitor: the model holds no moeflow MoE block; convert a transformers model with "
                             "moeflow.hf, or load it with ep_implementation='moeflow', or pass the model that holds "
                             "the layers")
        for position, layer in enumerate(self.layers):
            if layer.index is None:  # a standalone layer or a backend's block: numbered as the monitor sees it
                layer.index = position
        self.group = group if group is not None or not use_default_group else default_group()
        self.rules = rules or HealthRules()
        self.sinks = list(sinks)
        self.warn = warn if warn is not None else (self.group is None or dist.get_rank(self.group) == 0)
        self.alerts = AlertState(self.rules)
        self.steps_seen = 0
        self._windows = [_Window(layer.num_experts) for layer in self.layers]
        self._last_seen = [np.zeros(layer.num_experts, dtype=np.int64) for layer in self.layers]
        self._bytes_at = self._ledger_bytes()
        self._clock = time.perf_counter()
        self._hooks = [hook for layer, window in zip(self.layers, self._windows, strict=True)
                       for hook in self._watch(layer, window)]

    def _watch(self, layer: WatchedBlock, window: _Window) -> list[torch.utils.hooks.RemovableHandle]:
        """Hooks: a forward's statistics are folded in at the next forward (or the step); the router's
        logits give the entropy. A recompute (activation checkpointing) is not a new forward."""
        score_function = layer.score_function

        def before(module: nn.Module, args: object) -> None:
            if window.unread:
                window.fold(layer)

        def after(module: nn.Module, args: object, output: object) -> None:
            if not recomputing():
                window.unread = True

        def routed(module: nn.Module, args: object, output: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
            if recomputing():
                return
            logits_TE = output[0] if isinstance(output, tuple) else output
            logits_TE = logits_TE.reshape(-1, logits_TE.shape[-1])
            entropy = figures.router_entropy_sum(logits_TE, score_function)
            window.entropy = entropy if window.entropy is None else window.entropy + entropy
            window.routed += logits_TE.shape[0]

        hooks = [layer.module.register_forward_pre_hook(before), layer.module.register_forward_hook(after)]
        return hooks + ([layer.router.register_forward_hook(routed)] if layer.router is not None else [])

    def discard(self) -> None:
        """Forget the forwards since the last step (an evaluation between two training steps)."""
        for window in self._windows:
            window.reset()
        self._bytes_at = self._ledger_bytes()

    def observe(self, step: int | None = None, step_s: float | None = None) -> StepHealth:
        """This step's health (a collective over ``group``), with the alerts that fire first now;
        ``step_s`` defaults to the time since the last step. Writes nothing."""
        now = time.perf_counter()
        step_s = now - self._clock if step_s is None else step_s
        self.steps_seen += 1
        step = self.steps_seen if step is None else step
        for window, layer in zip(self._windows, self.layers, strict=True):
            if window.unread:
                window.fold(layer)
        step_s, totals = self._global_totals(step_s)
        layers = [self._layer_health(index, totals[index], step_s) for index in range(len(self.layers))]
        health = StepHealth(step, step_s, layers)
        health = dataclasses.replace(health, alerts=self.alerts.check(health, self.steps_seen))
        if self.warn:
            for alert in health.alerts:
                warnings.warn(f"moeflow: {alert.message}", MoEHealthWarning, stacklevel=2)
        self.discard()
        self._clock = time.perf_counter()
        return health

    def step(self, step: int | None = None, step_s: float | None = None) -> StepHealth:
        """:meth:`observe`, then each sink writes the step."""
        health = self.observe(step, step_s)
        for sink in self.sinks:
            sink.write(health.step, health.scalars(), health.loads(), health.record())
        return health

    def state_dict(self) -> dict[str, Any]:
        """What the monitor remembers between steps, as JSON: the steps seen, the step each expert last
        received a token, the collapse streaks and the alerts said. Every rank holds the same (its
        figures are global), so one rank's copy resumes them all."""
        last_seen = {str(layer.index): seen.tolist() for layer, seen in zip(self.layers, self._last_seen, strict=True)}
        return {"steps_seen": self.steps_seen, "last_seen": last_seen, **self.alerts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s state: a resumed run's dead-expert window and alerts go on
        where the interrupted run's stopped (a block it did not watch starts afresh)."""
        self.steps_seen = int(state["steps_seen"])
        for layer, seen in zip(self.layers, self._last_seen, strict=True):
            saved = state["last_seen"].get(str(layer.index))
            if saved is not None and len(saved) == len(seen):
                seen[:] = saved
        self.alerts.load_state_dict(state)

    def close(self) -> None:
        """Remove the hooks and close the sinks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for sink in self.sinks:
            sink.close()

    def _ledger_bytes(self) -> list[int]:
        return [layer.ledger.bytes_by_layer.get(layer.index, 0) for layer in self.layers]

    def _global_totals(self, step_s: float) -> tuple[float, list[list[float]]]:
        """The step's seconds and per layer [counts..., dropped, all-to-all seconds, entropy, routed
        tokens, bytes], over ``group``. The layers' statistics are already over their expert group,
        so their sum over the world is divided by its size (every expert group holds as many ranks);
        the seconds are the ranks' mean, so that every rank sees the same figures and alerts."""
        bytes_now = self._ledger_bytes()
        rows = []
        for window, sent, before in zip(self._windows, bytes_now, self._bytes_at, strict=True):
            entropy = 0.0 if window.entropy is None else float(window.entropy)
            rows.append([*window.counts.tolist(), window.dropped, window.alltoall_s(), entropy, window.routed,
                         sent - before])
        if self.group is None:
            return step_s, rows
        flat = [step_s, *(value for row in rows for value in row)]
        ledger = self.layers[0].ledger
        with tracked(ledger, "monitor all-reduce", self.group, len(flat) * 8):
            reduced = reduce_values(flat, self.group)
        ranks = dist.get_world_size(self.group)
        out, offset = [], 1
        for layer, row in zip(self.layers, rows, strict=True):
            values, offset = reduced[offset : offset + len(row)], offset + len(row)
            experts = layer.num_experts
            out.append([value / layer.stats_ranks for value in values[: experts + 1]]
                       + [values[experts + 1] / ranks, *values[experts + 2 :]])
        return reduced[0] / ranks, out

    def _layer_health(self, index: int, totals: list[float], step_s: float | None) -> LayerHealth:
        layer, last_seen = self.layers[index], self._last_seen[index]
        experts = layer.num_experts
        counts = [round(value) for value in totals[:experts]]
        dropped, alltoall_s, entropy, routed, sent = totals[experts:]
        dropped = round(dropped)
        last_seen[np.asarray(counts) > 0] = self.steps_seen
        dead = np.flatnonzero(self.steps_seen - last_seen >= self.rules.dead_window).tolist()
        bias = layer.bias()
        bias_min, bias_max = (0.0, 0.0) if bias is None else (float(bias.detach().min()), float(bias.detach().max()))
        timed = alltoall_s if layer.timed else None
        plan = layer.last_stats.plan if layer.last_stats is not None else None
        return LayerHealth(
            block=int(layer.index), tokens_per_expert=counts,
            load_max_over_mean=max_over_mean(counts),
            load_cv=figures.load_coefficient_of_variation(counts), busiest_share=figures.busiest_share(counts),
            dead_experts=dead, dropped=dropped, dropped_share=figures.dropped_share(dropped, sum(counts)),
            router_entropy=entropy / routed if routed else None,
            bias_min=bias_min, bias_max=bias_max,
            schedule=plan.schedule if plan else None, pipeline_degree=plan.pipeline_degree if plan else None,
            alltoall=plan.alltoall if plan else None, token_exchange=plan.token_exchange if plan else None,
            bytes_sent=round(sent), alltoall_s=timed,
            alltoall_share=timed / step_s if step_s and timed is not None else None,
        )
