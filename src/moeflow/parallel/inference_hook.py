"""What a layer asks of a per-forward placement's scheduler (Lina's inference scheduling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from moeflow.core.routing.selection import ExpertChoice
from moeflow.parallel.expert_fetch import ExpertFetch
from moeflow.parallel.placement import ExpertPlacement

Fetch = Callable[[ExpertPlacement], ExpertFetch]
"""Start fetching the weights a placement needs from where a layer stores them (a collective)."""


class InferenceHook(Protocol):
    """The scheduler of one layer (:class:`moeflow.inference.LayerScheduling`): it sees the gate's
    choice, estimates what the tokens will select next, and places the experts for this forward."""

    def routed(self, choice: ExpertChoice, num_experts: int, rank: int) -> ExpertChoice:
        """The gate's choice as the layer will use it (seen by the scheduler)."""
        ...

    def estimate(self, num_tokens: int) -> np.ndarray | None:
        """After the gate: this rank's expected selections per expert at the layers the scheduler
        places ahead of their gates (a flat array the layer sums over ranks on its all-gather of
        the routing counts, without reading it; None: nothing to carry)."""
        ...

    def placement(
        self, load_E: torch.Tensor, estimate: np.ndarray | None, storage: ExpertPlacement, fetch: Fetch
    ) -> ExpertFetch:
        """This forward's placement and its experts' weights (fetched with ``fetch`` from
        ``storage``, the layer's own placement, or started a layer ahead), from every rank's kept
        selections ``load_E`` and the sum of every rank's :meth:`estimate`."""
        ...
