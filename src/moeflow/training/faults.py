"""Faults injected into a training run on purpose, for the tests of what the job does about them.

The plan is passed in (``run_training(..., faults=FaultPlan(...))``, carried by the job to every
worker), never read from the environment: a run without one has no fault path at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FaultPlan:
    """``nonfinite_loss``: (rank, step) pairs whose training loss becomes NaN, as an overflow or a
    bad batch would make it."""

    nonfinite_loss: tuple[tuple[int, int], ...] = ()

    def loss(self, loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
        """``loss``, or NaN in its place where the plan says so (the graph stays: the backward runs)."""
        return loss * float("nan") if (rank, step) in self.nonfinite_loss else loss
