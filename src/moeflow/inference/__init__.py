"""Lina's inference scheduling: token-path profiles, popularity estimates and per-batch placements.

:func:`schedule_layers` attaches an :class:`InferenceScheduler` to a model's MoE layers (in
forward order); each layer then computes, per forward, the experts of the placement its scheduler
chose, fetching from their owners the ones it does not store (:mod:`moeflow.parallel.dynamic`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from moeflow.inference.assignment import (
    MAX_EXPERTS_PER_RANK,
    first_fit_decreasing,
    popularity_assignment,
    popularity_placement,
)
from moeflow.inference.paths import PATH_LENGTH, PROFILE_FILE, RoutingProfile, routing_fingerprint
from moeflow.inference.scheduler import (
    INFERENCE_SCHEDULES,
    InferenceScheduler,
    LayerRecord,
    LayerScheduling,
    SchedulerSettings,
)
from moeflow.moe.layer import MoELayer
from moeflow.parallel.dynamic import DynamicPlacementSchedule
from moeflow.parallel.expert_fetch import start_fetch
from moeflow.parallel.expert_parameters import holds_shards
from moeflow.parallel.inference_hook import Fetch, InferenceHook
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.registry import check_techniques

__all__ = [
    "INFERENCE_SCHEDULES",
    "MAX_EXPERTS_PER_RANK",
    "PATH_LENGTH",
    "PROFILE_FILE",
    "InferenceScheduler",
    "LayerRecord",
    "LayerScheduling",
    "RoutingProfile",
    "SchedulerSettings",
    "first_fit_decreasing",
    "popularity_assignment",
    "popularity_placement",
    "routing_fingerprint",
    "schedule_layer",
    "schedule_layers",
]

_RENAMED = {"popularity_plan": "popularity_assignment"}
"""Old names kept for one release: what a rank holds is an assignment, not a plan."""


def __getattr__(name: str) -> Any:
    if name not in _RENAMED:
        raise AttributeError(f"module 'moeflow.inference' has no attribute {name!r}")
    warnings.warn(f"moeflow.inference.{name} is now moeflow.inference.{_RENAMED[name]} ({name} goes in the next "
                  "release)", DeprecationWarning, stacklevel=2)
    return globals()[_RENAMED[name]]


def schedule_layers(layers: Sequence[MoELayer], scheduler: InferenceScheduler | None) -> None:
    """Schedule ``layers`` (a model's MoE layers, in forward order) with ``scheduler``, or put their
    own placements back with None; a collective over each layer's expert group."""
    if scheduler is not None:
        if scheduler.num_layers != len(layers):
            raise ValueError(f"the scheduler was built for {scheduler.num_layers} MoE layers; the model has "
                             f"{len(layers)}")
        for layer in layers:
            scheduler.check_layer(layer.config.num_experts, layer.world_size)
            if holds_shards(layer.experts):
                raise ValueError("Lina's inference scheduling fetches experts' weights ahead of their layer: it "
                                 "needs them whole, not FSDP2-sharded (expert_fully_shard(..., shard_experts=False))")
    for index, layer in enumerate(layers):
        schedule_layer(layer, None if scheduler is None else scheduler.hook(index))
        if scheduler is not None:  # the layer before it may fetch its copies ahead
            weight = layer.experts.w1  # a GPU moves copies on its own engine; a CPU rank's core moves them
            scheduler.attach(index, _fetcher(layer), layer.placement, layer.config.dims, weight.element_size(),
                             hides_copies=weight.is_cuda)


def _fetcher(layer: MoELayer) -> Fetch:
    """Start fetching the weights ``layer`` computes under a placement, from where it stores them."""
    return lambda placement: start_fetch(layer.experts.weights(), layer.placement, placement, layer.rank,
                                         layer.groups)


def schedule_layer(layer: MoELayer, hook: InferenceHook | None) -> None:
    """With a hook (:class:`LayerScheduling`), each forward computes the experts of the placement
    the hook chooses for that forward (:class:`~moeflow.parallel.dynamic.DynamicPlacementSchedule`),
    the experts staying where they are stored (a placement of hidden slices is first regrouped into
    whole experts, expert parallel: a collective); None puts the layer's own schedule, placement and
    planner back."""
    current = layer.schedule
    if hook is None:
        if isinstance(current, DynamicPlacementSchedule):
            schedule, placement, planner = current.previous  # type: ignore[misc]
            layer.switch(schedule, placement, planner=planner)
        return
    if isinstance(current, DynamicPlacementSchedule):
        layer.switch(DynamicPlacementSchedule(hook, current.previous), layer.placement, planner=layer.planner)
        return
    check_techniques(layer.config, layer.schedule.name, applied=("inference scheduling",))
    config = layer.config
    storage = layer.placement if layer.placement.holds_whole_experts else ExpertPlacement.expert_parallel(
        config.num_experts, layer.world_size, config.hidden_dim)
    layer.switch(DynamicPlacementSchedule(hook, (current, layer.placement, layer.planner)), storage)
