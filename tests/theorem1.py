"""PipeMoE's Theorem 1 (the closed-form optimal pipeline degree, Algorithm 1): the tests' oracle of
the event recurrences that moeflow's planners enumerate. It left the library because it decides
nothing the enumeration does not: where its assumptions hold (a forward pass, equal chunks, one
shared network) its degree is the recurrence's minimum, and the planners also price the backward,
uneven chunks and interference, which the closed form does not cover."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moeflow.perf.cost import CostModel
from moeflow.perf.pipeline import chunk_costs
from moeflow.perf.shape import RegionShape


@dataclass(frozen=True)
class Theorem1Choice:
    degree: int
    predicted_s: float
    case: str  # "r=1", "Q1" (communication-bound), "Q2" (computation-bound) or "notQ2"


def theorem1_degree(
    alpha_a: float, beta_a: float, n_d: float, alpha_e: float, beta_e: float, n_e: float, max_degree: int,
    interference: float = 1.0, degrees: Iterable[int] | None = None,
) -> Theorem1Choice:
    """Theorem 1: the best degree from the case split of Eq. 19-44, with t_a2a(n) = alpha_a + beta_a n
    and t_e(n) = alpha_e + beta_e n for the whole (unsplit) layer sizes n_d and n_e.

    For r >= 2 exactly one of the cases holds: Q1 (Eq. 21) gives f2 (Eq. 25); not Q1 and Q2 (Eq. 30)
    gives f3 (Eq. 34); neither gives f4 (Eq. 41). Each case's objective is minimised over the integer
    degrees where the case holds (f2 and f4 grow with r; f3 is convex), and r = 1 (Eq. 19) wins ties.
    ``interference`` scales the expert time of overlapped (r >= 2) runs, as the calibrated profile
    measured it. ``degrees``: the degrees allowed (default 1 to ``max_degree``).
    """
    best = Theorem1Choice(1, 2 * (alpha_a + beta_a * n_d) + alpha_e + beta_e * n_e, "r=1")
    alpha_e, beta_e = alpha_e * interference, beta_e * interference
    for r in sorted(set(degrees or range(2, max_degree + 1)) - {1}):
        q1 = alpha_a + beta_a * n_d / r >= alpha_e + beta_e * n_e / r
        q2 = 2 * (r - 1) * alpha_a + 2 * (r - 1) / r * beta_a * n_d < r * alpha_e + beta_e * n_e
        if q1:
            time, case = 2 * r * alpha_a + 2 * n_d * beta_a, "Q1"
        elif q2:
            time, case = 2 * alpha_a + beta_e * n_e + 2 * beta_a * n_d / r + alpha_e * r, "Q2"
        else:
            time, case = 2 * alpha_a * r + 2 * n_d * beta_a, "notQ2"
        if time < best.predicted_s:
            best = Theorem1Choice(r, time, case)
    return best


def theorem1_for_shape(
    cost: CostModel, shape: RegionShape, algorithm: str, max_degree: int, degrees: Iterable[int] | None = None
) -> Theorem1Choice:
    """Theorem 1 on the forward pass with the planner's own costs: the all-to-all and expert times
    of :func:`chunk_costs` (the FFN fits where calibrated), read as t(n) = alpha + beta n from the
    whole layer and from an empty chunk. Where its assumptions hold (chunks of equal size, one
    shared network) its degree is the recurrence's best, so the ``model`` policy's on a forward."""
    whole_a2a, whole_expert, _ = (times[0] for times in chunk_costs(cost, shape, 1, algorithm))
    empty = RegionShape(shape.dims, shape.world_size, 0, shape.bytes_per_element)
    zero_a2a, zero_expert, _ = (times[0] for times in chunk_costs(cost, empty, 1, algorithm))
    layer = shape.dims
    n_d = layer.num_experts * shape.capacity * layer.model_dim * shape.bytes_per_element  # bytes sent
    n_e = shape.world_size * shape.capacity  # rows the local experts compute
    overlapped = shape.world_size > 1  # chunk_costs slows overlapped experts down only when they overlap
    return theorem1_degree(
        zero_a2a, (whole_a2a - zero_a2a) / n_d, n_d, zero_expert, (whole_expert - zero_expert) / n_e, n_e,
        max_degree, cost.profile.interference if overlapped else 1.0, degrees,
    )
