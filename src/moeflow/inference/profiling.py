"""Recording token paths (Lina's profiling stage): run a model over a corpus on one process and
keep every token's choices at every MoE layer, then build the :class:`RoutingProfile`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from moeflow.inference import schedule_layers
from moeflow.inference.paths import PATH_LENGTH, RoutingProfile, routing_fingerprint
from moeflow.inference.scheduler import InferenceScheduler, SchedulerSettings
from moeflow.moe.layer import MoELayer


def token_batches(ids: np.ndarray, context: int, batch_size: int, max_tokens: int) -> list[torch.Tensor]:
    """(batch, context) windows of a token stream, up to ``max_tokens`` tokens in all."""
    if context < 1 or batch_size < 1 or max_tokens < 1:
        raise ValueError(f"context, batch_size and max_tokens must be >= 1, got {context}, {batch_size}, {max_tokens}")
    usable = min(len(ids), max_tokens) // context * context
    if usable == 0:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one sequence of {context}: give a longer one")
    windows = torch.as_tensor(np.asarray(ids[:usable], dtype=np.int64)).view(-1, context)
    return list(windows.split(batch_size))


def profile_routing(
    layers: Sequence[MoELayer], forward: Callable[[torch.Tensor], object], batches: Sequence[torch.Tensor],
    path_length: int = PATH_LENGTH, gather: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None,
) -> RoutingProfile:
    """The profile of ``layers`` (a model's MoE layers in forward order) over ``batches``, each run
    through ``forward``. On several ranks, ``gather`` turns this rank's routes of each forward into
    every rank's (a collective), so that every rank builds the same profile."""
    num_experts = layers[0].config.num_experts
    if {layer.config.num_experts for layer in layers} != {num_experts}:
        raise ValueError("every MoE layer of a profiled model needs the same number of experts")
    recording = SchedulerSettings("oracle", max_experts_per_rank=num_experts)  # any placement records the same
    scheduler = InferenceScheduler(recording, len(layers), keep_routes=True)
    schedule_layers(layers, scheduler)
    try:
        with torch.no_grad():
            for batch in batches:
                forward(batch)
    finally:
        schedule_layers(layers, None)
    routes = scheduler.routes if gather is None else gather(scheduler.routes)
    if not routes:
        raise ValueError("no forward reached every MoE layer: nothing to profile")
    fingerprint = routing_fingerprint([layer.gate for layer in layers])
    return RoutingProfile.from_routes(np.concatenate(routes), num_experts, fingerprint, path_length)
