"""A pipelined model's health from its stages': each stage's ranks watch only their own blocks, so
one rank joins the stages' figures into the step the whole model's monitor would have seen.

Each stage's :class:`~moeflow.metrics.MoEMonitor` covers its blocks over its stage's data ranks;
:class:`StageHealth` (rank 0's) takes one :class:`~moeflow.metrics.StepHealth` per stage a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moeflow.metrics.alerts import AlertState, HealthRules
from moeflow.metrics.health import StepHealth


def merge_stages(step: int, step_s: float | None, parts: Sequence[StepHealth | None]) -> StepHealth:
    """The whole model's step from its stages' (None: a rank that reports no stage): every block
    once, in block order, under ``step_s`` (the step as one rank timed it), without alerts (the
    step-wide all-to-all share is only known once every stage's layers are in)."""
    layers = sorted((layer for part in parts if part is not None for layer in part.layers),
                    key=lambda layer: layer.block)
    blocks = [layer.block for layer in layers]
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"merge_stages: a block is reported by two stages ({blocks}); pass one rank's health per "
                         "stage (its first data rank's)")
    return StepHealth(step, step_s, layers)


@dataclass
class StageHealth:
    """The whole model's health from its stages', a step at a time, with the alerts checked on the
    whole model (as one monitor would: each layer's, and the all-to-alls' share of the step over
    every stage's layers, which no stage sees alone)."""

    rules: HealthRules
    steps_seen: int = 0
    alerts: AlertState = field(init=False)

    def __post_init__(self) -> None:
        self.alerts = AlertState(self.rules)

    def merge(self, step: int, step_s: float | None, parts: Sequence[StepHealth | None]) -> StepHealth:
        """This step's whole-model health, with the alerts that fire first now."""
        self.steps_seen += 1
        health = merge_stages(step, step_s, parts)
        return dataclasses.replace(health, alerts=self.alerts.check(health, self.steps_seen))

    def state_dict(self, last_seen: dict[str, list[int]]) -> dict[str, Any]:
        """The whole model's monitor state, as :meth:`~moeflow.metrics.MoEMonitor.state_dict` writes it:
        ``last_seen`` joins the stages' monitors' (by block)."""
        return {"steps_seen": self.steps_seen, "last_seen": last_seen, **self.alerts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s (or a monitor's) state."""
        self.steps_seen = int(state["steps_seen"])
        self.alerts.load_state_dict(state)
