"""PipeMoE's model of a pipelined MoE layer: the event recurrences (Eq. 9-12) and per-plan
predictions on a calibrated profile. The planners enumerate the recurrence over the degrees; PipeMoE's
closed-form optimal degree (Theorem 1) gives the same degree where its assumptions hold and is kept
as the tests' oracle of the recurrence (``tests/theorem1.py``), not as code that decides.

The pipelined region is dispatch (D) -> experts (E) -> combine (C) on d capacity chunks. PipeMoE
assumes one communication resource: all-to-alls run one at a time. moeflow's executor has exactly
one communication worker that runs them in issue order D1..Dd, C1..Cd, so with
``shared_network=True`` the recurrence also makes C1 wait for Dd (Eq. 11 with that extra term);
``shared_network=False`` is Eq. 9-12 as printed. Plain math on numbers; no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moeflow.perf.cost import CostModel
from moeflow.perf.shape import RegionShape


def capacity_chunks(capacity: int, degree: int) -> list[tuple[int, int]]:
    """Split slots [0, capacity) into min(degree, capacity) contiguous ranges whose sizes differ by
    at most one (at least one range, empty when capacity is 0)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"pipeline degree must be an integer >= 1, got {degree!r}")
    parts = max(1, min(degree, capacity))
    base, extra = divmod(capacity, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def pipeline_makespan(
    t_dispatch: Sequence[float], t_expert: Sequence[float], t_combine: Sequence[float],
    shared_network: bool = True,
) -> float:
    """Eq. 9-12: time from the start of D1 to the end of Cr for chunk times t_d, t_e, t_c."""
    chunks = len(t_dispatch)
    if not (chunks == len(t_expert) == len(t_combine)) or chunks == 0:
        raise ValueError("t_dispatch, t_expert and t_combine need one entry per chunk (at least one)")
    start_d = [0.0] * chunks
    for i in range(1, chunks):
        start_d[i] = start_d[i - 1] + t_dispatch[i - 1]  # Eq. 9
    start_e = [start_d[0] + t_dispatch[0]] + [0.0] * (chunks - 1)
    for i in range(1, chunks):
        start_e[i] = max(start_e[i - 1] + t_expert[i - 1], start_d[i] + t_dispatch[i])  # Eq. 10
    last_dispatch_end = start_d[-1] + t_dispatch[-1] if shared_network else 0.0
    start_c = [max(start_e[0] + t_expert[0], last_dispatch_end)] + [0.0] * (chunks - 1)
    for i in range(1, chunks):
        start_c[i] = max(start_e[i] + t_expert[i], start_c[i - 1] + t_combine[i - 1])  # Eq. 11
    return start_c[-1] + t_combine[-1] - start_d[0]  # Eq. 12


@dataclass(frozen=True)
class PlanPrediction:
    """Predicted seconds of one plan. ``gradient_sync_s`` is what the choice costs the trainer
    (replicated experts: the all-reduce of their gradients); ``expert_memory_bytes`` the expert
    weights one rank holds."""

    degree: int
    algorithm: str
    forward_s: float
    backward_s: float
    gradient_sync_s: float = 0.0
    expert_memory_bytes: int = 0
    schedule: str = "expert"

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.gradient_sync_s


def chunk_costs(
    cost: CostModel, shape: RegionShape, degree: int, algorithm: str, r: int = 1, row_share: float = 1.0
) -> tuple[list[float], list[float], list[float]]:
    """(all-to-all seconds, expert forward seconds, expert backward seconds) of each chunk; the
    all-to-all sends ``row_share`` of the chunk's rows.

    ``r`` is Tutel's r >= 1 (§3.1, Table 4 row 7) when W > E: each chunk is sent r times (to the r
    hidden blocks of its expert) split over g = (W / E) / r ranks, and each rank runs one GEMM of
    W * Cj / g rows on H / r hidden units. r = 1 with W <= E is plain expert parallelism."""
    overlap = degree > 1 and shape.world_size > 1
    slowdown = cost.profile.interference if overlap else 1.0
    group = shape.hidden_shards // r
    layer = shape.dims
    t_a2a, t_expert, t_back = [], [], []
    for start, stop in capacity_chunks(shape.capacity, degree):
        rows = -(-(stop - start) // group) * group  # padded to a multiple of g
        size = r * layer.num_experts * rows * shape.row_bytes * row_share
        t_a2a.append(cost.t_alltoall(algorithm, size) if shape.world_size > 1 else 0.0)
        dims = (shape.world_size * rows // group, layer.model_dim, layer.hidden_dim // r, layer.projections)
        t_expert.append(shape.local_experts * cost.t_ffn(*dims) * slowdown)
        t_back.append(shape.local_experts * cost.t_ffn(*dims, backward=True) * slowdown)
    return t_a2a, t_expert, t_back


def predict_plan(
    cost: CostModel, shape: RegionShape, degree: int, algorithm: str, backward: bool = True,
    row_share: float = 1.0,
) -> PlanPrediction:
    """Forward (and backward: the same pipeline with twice the expert GEMM work) of one plan.
    ``row_share``: the share of the buffer's rows each all-to-all sends, below 1 where a token
    crosses to each rank once (``token_exchange='dedup'``)."""
    t_a2a, t_expert, t_back = chunk_costs(cost, shape, degree, algorithm, row_share=row_share)
    forward = pipeline_makespan(t_a2a, t_expert, t_a2a)
    back = pipeline_makespan(t_a2a, t_back, t_a2a) if backward else 0.0
    memory = shape.local_experts * shape.dims.expert_parameters * shape.bytes_per_element
    return PlanPrediction(degree, algorithm, forward, back, expert_memory_bytes=memory)


def usable_degrees(degrees: Iterable[int], capacity: int) -> list[int]:
    """The distinct degrees that really run: above the capacity a degree collapses onto it (one
    slot per chunk, see :func:`capacity_chunks`)."""
    return sorted({min(d, max(1, capacity)) for d in degrees})


def rank_plans(
    cost: CostModel, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], backward: bool = True
) -> list[PlanPrediction]:
    """Every (degree, algorithm) candidate, fastest predicted first; degrees above the capacity
    collapse onto the capacity (one slot per chunk) and are listed once."""
    usable = usable_degrees(degrees, shape.capacity)
    predictions = [predict_plan(cost, shape, d, a, backward) for a in algorithms for d in usable]
    return sorted(predictions, key=lambda p: (p.total_s, p.degree))


__all__ = [
    "PlanPrediction",
    "capacity_chunks",
    "chunk_costs",
    "pipeline_makespan",
    "predict_plan",
    "rank_plans",
    "usable_degrees",
]
