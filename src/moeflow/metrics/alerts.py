"""What makes an MoE run fail quietly, said once, naming the layer and the setting that helps: a
router collapsed onto one expert, an expert no token reached for a window, a layer that drops a
large share of its tokens, an all-to-all that takes most of the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moeflow.metrics.health import LayerHealth, StepHealth

COLLAPSED = "collapsed_router"
DEAD_EXPERT = "dead_expert"
DROPS = "drops"
ALLTOALL = "alltoall"
ALERT_KINDS = (COLLAPSED, DEAD_EXPERT, DROPS, ALLTOALL)
BALANCE = ("balance the router: a larger load-balancing loss weight (--aux-loss-weight, MoEConfig.aux_loss_weight) "
           "or loss-free balancing (MoEConfig.expert_bias_update_rate, e.g. 0.001)")
"""What the alerts about the load advise."""


@dataclass(frozen=True)
class HealthRules:
    """When an alert fires: one expert over ``collapse_share`` of a layer's assignments for
    ``collapse_steps`` steps in a row; an expert without a token for ``dead_window`` steps (also the
    window of :attr:`LayerHealth.dead_experts`); a layer dropping over ``max_dropped_share`` of its
    assignments; the all-to-alls over ``max_alltoall_share`` of the step (after ``warmup_steps``,
    whose planner trials and first calls are not the run's)."""

    collapse_share: float = 0.5
    collapse_steps: int = 10
    dead_window: int = 50
    max_dropped_share: float = 0.2
    max_alltoall_share: float = 0.5
    warmup_steps: int = 5

    def __post_init__(self) -> None:
        for name in ("collapse_share", "max_dropped_share", "max_alltoall_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"HealthRules.{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("collapse_steps", "dead_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"HealthRules.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"HealthRules.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class Alert:
    """One alert: its kind, the layer (None: the whole step), the step it fired at, and the message."""

    kind: str
    block: int | None
    step: int
    message: str

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "block": self.block, "step": self.step, "message": self.message}


@dataclass
class AlertState:
    """What the rules remember between steps: each layer's steps in a row over the collapse share,
    and which alerts fired already (each (kind, layer) fires once)."""

    rules: HealthRules
    collapsed_for: dict[int, int] = field(default_factory=dict)
    fired: set[tuple[str, int | None]] = field(default_factory=set)

    def state_dict(self) -> dict[str, Any]:
        """The streaks and the alerts said, as JSON (a resumed run says none twice)."""
        return {"collapsed_for": {str(block): steps for block, steps in self.collapsed_for.items()},
                "fired": sorted([kind, block] for kind, block in self.fired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s state."""
        self.collapsed_for = {int(block): int(steps) for block, steps in state.get("collapsed_for", {}).items()}
        self.fired = {(str(kind), None if block is None else int(block)) for kind, block in state.get("fired", [])}

    def check(self, health: StepHealth, steps_seen: int) -> list[Alert]:
        """The alerts that fire first at this step."""
        found = [alert for layer in health.layers for alert in self._layer_alerts(layer, health.step, steps_seen)]
        share = health.alltoall_share
        if steps_seen > self.rules.warmup_steps and share is not None and share > self.rules.max_alltoall_share:
            found.append(Alert(ALLTOALL, None, health.step, (
                f"the all-to-alls took {share:.0%} of step {health.step} (over {self.rules.max_alltoall_share:.0%}): "
                "send only the kept tokens (token_exchange='ragged' or 'auto', --token-exchange), overlap them with "
                "the experts (pipeline='auto', --pipeline), or keep tokens on their node (--topology-gate)")))
        fresh = [alert for alert in found if (alert.kind, alert.block) not in self.fired]
        self.fired.update((alert.kind, alert.block) for alert in fresh)
        return fresh

    def _layer_alerts(self, layer: LayerHealth, step: int, steps_seen: int) -> list[Alert]:
        rules, found = self.rules, []
        over = layer.busiest_share > rules.collapse_share and sum(layer.tokens_per_expert) > 0
        self.collapsed_for[layer.block] = self.collapsed_for.get(layer.block, 0) + 1 if over else 0
        if self.collapsed_for[layer.block] >= rules.collapse_steps:
            expert = layer.tokens_per_expert.index(max(layer.tokens_per_expert))
            found.append(Alert(COLLAPSED, layer.block, step, (
                f"block {layer.block}'s router collapsed: expert {expert} took over {rules.collapse_share:.0%} of its "
                f"tokens for {rules.collapse_steps} steps in a row; {BALANCE}, or lower the learning rate")))
        if layer.dead_experts:
            found.append(Alert(DEAD_EXPERT, layer.block, step, (
                f"block {layer.block}: expert(s) {layer.dead_experts} received no token for {rules.dead_window} "
                f"steps; {BALANCE}")))
        if layer.dropped_share > rules.max_dropped_share:
            found.append(Alert(DROPS, layer.block, step, (
                f"block {layer.block} dropped {layer.dropped_share:.0%} of its assignments at step {step} (over "
                f"{rules.max_dropped_share:.0%}): raise the capacity factor (--capacity-factor 1.5, or 0 to drop "
                f"none), or {BALANCE}")))
        return found
