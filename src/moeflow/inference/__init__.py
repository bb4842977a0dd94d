"""Lina's inference scheduling: token-path profiles, popularity estimates and per-batch placements.

:func:`schedule_layers` attaches an :class:`InferenceScheduler` to a model's MoE layers (in
forward order); each layer then keeps every expert's weights and computes, per forward, the
experts of the placement its scheduler chose (:mod:`moeflow.parallel.dynamic`).
"""

from __future__ import annotations

from collections.abc import Sequence

from moeflow.inference.paths import PATH_LENGTH, PROFILE_FILE, RoutingProfile, routing_fingerprint
from moeflow.inference.plan import MAX_EXPERTS_PER_RANK, first_fit_decreasing, popularity_placement, popularity_plan
from moeflow.inference.scheduler import (
    INFERENCE_SCHEDULES,
    InferenceScheduler,
    LayerRecord,
    LayerScheduling,
    SchedulerSettings,
)
from moeflow.layer import MoELayer
from moeflow.parallel.dynamic import DynamicPlacementSchedule
from moeflow.parallel.inference_hook import InferenceHook
from moeflow.parallel.placement import ExpertPlacement

__all__ = [
    "INFERENCE_SCHEDULES", "MAX_EXPERTS_PER_RANK", "PATH_LENGTH", "PROFILE_FILE", "InferenceScheduler", "LayerRecord",
    "LayerScheduling", "RoutingProfile", "SchedulerSettings", "first_fit_decreasing", "popularity_placement",
    "popularity_plan", "routing_fingerprint", "schedule_layer", "schedule_layers",
]


def schedule_layers(layers: Sequence[MoELayer], scheduler: InferenceScheduler | None) -> None:
    """Schedule ``layers`` (a model's MoE layers, in forward order) with ``scheduler``, or put their
    own placements back with None; a collective over each layer's expert group."""
    if scheduler is not None:
        if scheduler.num_layers != len(layers):
            raise ValueError(f"the scheduler was built for {scheduler.num_layers} MoE layers; the model has "
                             f"{len(layers)}")
        for layer in layers:
            scheduler.check_layer(layer.config.num_experts, layer.world_size)
    for index, layer in enumerate(layers):
        schedule_layer(layer, None if scheduler is None else scheduler.hook(index))


def schedule_layer(layer: MoELayer, hook: InferenceHook | None) -> None:
    """With a hook (:class:`LayerScheduling`), every rank gathers every expert's weights (a
    collective) and each forward computes the experts of the placement the hook chooses for that
    forward (:class:`~moeflow.parallel.dynamic.DynamicPlacementSchedule`); None puts the layer's
    own schedule, placement and planner back (a collective)."""
    current = layer.schedule
    if hook is None:
        if isinstance(current, DynamicPlacementSchedule):
            schedule, placement, planner = current.previous  # type: ignore[misc]
            layer.switch(schedule, placement, planner=planner)
        return
    if isinstance(current, DynamicPlacementSchedule):
        layer.switch(DynamicPlacementSchedule(hook, current.previous), layer.placement, planner=layer.planner)
        return
    _check_schedulable(layer)
    config = layer.config
    replicated = ExpertPlacement.replicated(config.num_experts, layer.world_size, config.hidden_dim)
    layer.switch(DynamicPlacementSchedule(hook, (current, layer.placement, layer.planner)), replicated)


def _check_schedulable(layer: MoELayer) -> None:
    config = layer.config
    others = {"shadowing": config.shadowing != "off", "redundant_experts": config.redundant_experts > 0,
              "topology_gate": config.topology_gate != "off", "mp_group": layer.groups.model is not None,
              f"parallel={layer.schedule.name!r}": layer.schedule.name not in ("expert", "replicated")}
    if clash := [name for name, on in others.items() if on]:
        raise ValueError(f"inference scheduling places the experts per batch over whole experts; this layer "
                         f"uses {', '.join(clash)}: build it with parallel='expert' and those off")
