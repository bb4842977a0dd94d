"""EPLB in training: every ``interval`` steps, each MoE layer with redundant slots is placed for the
load its router gave over the last ``window`` steps, moving weights and optimizer state once per
change. The loads are global (every rank records the same, summed over the expert groups' copies
under ``--ep-size``), so every rank places the same way.
A layer with ``balance='auto'`` first chooses, for that load, among no balancing, shadowing and
the slots (:mod:`moeflow.parallel.balance`).

Its state (the recorded window and the load each layer was last placed for) goes into the
checkpoint: a resumed run places its layers for the same load and continues exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.collectives import reduce_values
from moeflow.comm.groups import group_size
from moeflow.models import TrainableLM
from moeflow.moe.layer import MoELayer
from moeflow.parallel.balance import choose_execution
from moeflow.parallel.redundant import balanced_placement


@dataclass
class ExpertRebalancer:
    interval: int
    window: int
    history: dict[int, deque[list[int]]] = field(default_factory=dict)  # block -> recent tokens_per_expert
    placed_for: dict[int, list[int]] = field(default_factory=dict)  # block -> the load of its placement
    placed_steps: dict[int, int] = field(default_factory=dict)  # block -> the steps that load covers
    replicas: dist.ProcessGroup | None = None  # --ep-size: the expert groups' copies, whose loads add up

    def record(self, model: TrainableLM) -> None:
        """Append this step's load of every layer with redundant slots: the load of its expert
        group, summed over the copies of that group (one all-reduce for all layers), so that every
        copy places its experts alike and their gradients keep lining up."""
        loads = {block: layer.last_stats.tokens_per_expert for block, layer in _redundant_layers(model)
                 if layer.last_stats is not None}
        if group_size(self.replicas) > 1 and loads:
            summed = iter(reduce_values([count for load in loads.values() for count in load], self.replicas))
            loads = {block: [round(next(summed)) for _ in load] for block, load in loads.items()}
        for block, load in loads.items():
            self.history.setdefault(block, deque(maxlen=self.window)).append(list(load))

    def step(self, step: int, model: TrainableLM, optimizer: torch.optim.Optimizer) -> list[int]:
        """After ``step``'s update: on every ``interval``-th step, place each layer for its recorded
        load; return the blocks whose placement changed (a collective on those steps)."""
        if step % self.interval or not self.history:
            return []
        changed = []
        for block, layer in _redundant_layers(model):
            window = self.history.get(block)
            if not window:
                continue
            load = [sum(column) for column in zip(*window, strict=True)]
            if rebalance_layer(layer, load, optimizer, steps=len(window)):
                changed.append(block)
            self.placed_for[block], self.placed_steps[block] = load, len(window)
        return changed

    def state(self) -> dict[str, Any]:
        return {
            "history": {str(b): list(h) for b, h in self.history.items()},
            "placed_for": {str(b): load for b, load in self.placed_for.items()},
            "placed_steps": {str(b): steps for b, steps in self.placed_steps.items()},
        }

    def restore(self, state: dict[str, Any], model: TrainableLM, optimizer: torch.optim.Optimizer) -> None:
        """Back to a checkpoint's state: the window, and each layer placed for its saved load."""
        self.history = {int(b): deque(h, maxlen=self.window) for b, h in state.get("history", {}).items()}
        self.placed_for = {int(b): list(load) for b, load in state.get("placed_for", {}).items()}
        self.placed_steps = {int(b): int(steps) for b, steps in state.get("placed_steps", {}).items()}
        for block, layer in _redundant_layers(model):
            if block in self.placed_for:
                rebalance_layer(layer, self.placed_for[block], optimizer, steps=self.placed_steps.get(block, 1))


def _redundant_layers(model: TrainableLM) -> list[tuple[int, Any]]:
    return [(block, layer) for block, layer in zip(model.moe_block_indices(), model.moe_layers(), strict=True)
            if layer.config.redundant_experts]


def rebalance_layer(
    layer: MoELayer, load_E: Sequence[float], optimizer: torch.optim.Optimizer | None = None, steps: int = 1
) -> bool:
    """EPLB: place a layer's slots for ``load_E`` (tokens per expert over ``steps`` steps, the same
    on every rank, e.g. the recorded ``tokens_per_expert`` of the last steps) and move the weights
    and ``optimizer``'s state once if the placement changed; return whether the layer changed (a
    collective). Under ``balance='auto'`` the layer first chooses its technique for that load."""
    config = layer.config
    if not config.redundant_experts:
        raise ValueError("rebalancing places redundant experts: build the layer with redundant_experts > 0")
    if len(load_E) != config.num_experts:
        raise ValueError(f"load_E has {len(load_E)} entries; it needs one per expert ({config.num_experts})")
    if config.balance == "auto":
        assert layer.cost_model is not None  # the layer's build requires a profile for balance='auto'
        chosen = choose_execution(config, layer.schedule, layer.groups.topology, layer.cost_model,
                                  [load / max(1, steps) for load in load_E])
        schedule, new = chosen.schedule, chosen.placement
    else:
        schedule = layer.schedule
        new = balanced_placement(load_E, layer.num_local_experts, layer.groups.topology, config.hidden_dim)
    if new == layer.placement and schedule == layer.schedule:
        return False
    layer.switch(schedule, new, optimizer)
    return True
