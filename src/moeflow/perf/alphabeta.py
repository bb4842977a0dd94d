"""Alpha-beta cost models t = alpha + beta * x (PipeMoE Eq. 13/16, Parm Eq. 12), fitted by least squares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    """Startup cost ``alpha`` (seconds) plus ``beta`` seconds per unit of x; ``r2`` of the fit."""

    alpha: float
    beta: float
    r2: float = 1.0
    unit: str = ""

    def __call__(self, x: float) -> float:
        return self.alpha + self.beta * x

    def to_dict(self) -> dict[str, float | str]:
        return {"alpha": self.alpha, "beta": self.beta, "r2": self.r2, "unit": self.unit}

    @classmethod
    def from_dict(cls, values: dict) -> AlphaBeta:
        return cls(
            float(values["alpha"]), float(values["beta"]), float(values.get("r2", 1.0)), str(values.get("unit", ""))
        )


def fit_alpha_beta(xs: Sequence[float], seconds: Sequence[float], unit: str = "") -> AlphaBeta:
    """Ordinary least-squares line through (x, t), as PipeMoE fits its models. Alpha is clamped at
    0: a negative startup cost is noise."""
    x = np.asarray(xs, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.size < 2 or x.size != t.size or np.ptp(x) == 0:
        raise ValueError("fitting alpha-beta needs at least two distinct x values with one time each")
    beta, alpha = np.polyfit(x, t, 1)
    if alpha < 0:  # refit through the origin
        alpha, beta = 0.0, float(np.dot(x, t) / np.dot(x, x))
    predicted = alpha + beta * x
    total = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((t - predicted) ** 2)) / total if total > 0 else 1.0
    return AlphaBeta(float(alpha), float(beta), r2, unit)


def median_relative_error(model: AlphaBeta, xs: Sequence[float], seconds: Sequence[float]) -> float:
    """Median of ``|predicted - measured| / measured`` over held-out points."""
    errors = [abs(model(x) - t) / t for x, t in zip(xs, seconds, strict=True) if t > 0]
    return float(np.median(errors)) if errors else 0.0
