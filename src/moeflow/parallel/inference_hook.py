"""What a layer asks of a per-forward placement's scheduler (Lina's inference scheduling)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from moeflow.parallel.placement import ExpertPlacement
from moeflow.routing.selection import ExpertChoice


class InferenceHook(Protocol):
    """The scheduler of one layer (:class:`moeflow.inference.LayerScheduling`): it estimates the
    load before the gate, sees the gate's choice, and places the experts for this forward."""

    def estimate(self, num_tokens: int) -> np.ndarray | None:
        """This rank's expected selections per expert, before the gate (None: no estimate)."""
        ...

    def routed(self, choice: ExpertChoice, num_experts: int, rank: int) -> ExpertChoice:
        """The gate's choice as the layer will use it (seen by the scheduler)."""
        ...

    def placement(
        self, load_E: torch.Tensor, estimate_E: np.ndarray | None, storage: ExpertPlacement
    ) -> ExpertPlacement:
        """This forward's placement from every rank's kept selections and estimates, for experts
        stored as ``storage`` places them (the layer's own placement)."""
        ...
