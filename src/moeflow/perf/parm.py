"""Parm's cost model (Parm §III-B, Algorithm 1, Eq. 13-14) and that of the DeepSpeed-MoE
baseline it replaces (Eq. 1), each per capacity chunk in PipeMoE's recurrence: the numpy half of
the schedules in :mod:`moeflow.parallel.parm`, beside the others' in :mod:`moeflow.perf.schedule_models`.
Plain math on numbers; no torch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moeflow.perf.cost import CostModel
from moeflow.perf.pipeline import PlanPrediction, capacity_chunks, pipeline_makespan, usable_degrees
from moeflow.perf.schedule_models import Plan
from moeflow.perf.shape import RegionShape


def shard_count(mp_size: int, esp_size: int | None) -> int:
    """N_ESP: ``esp_size``, or N_MP where unset (Parm's real models' setting)."""
    return esp_size or mp_size


@dataclass(frozen=True)
class ParmChoice:
    """Algorithm 1's decision and the two times it compared (seconds)."""

    schedule: str
    t_d1: float
    t_d2: float


PARM_COMBINES = ("linear", "saa")
"""S2's combine: the fused all-to-all then the MP all-gather, or the two overlapped (SAA)."""


@dataclass(frozen=True)
class ParmModel:
    """Parm's S1 and S2 in PipeMoE's recurrence, per capacity chunk (``name`` "s1", "s2", or "parm"
    for both: Algorithm 1's choice between them, made here by ranking their predictions).

    - S1 (Eq. 13): each member sends its own tokens' slots, about Cj / N_MP per expert: the fused
      EP&ESP all-to-all of N_ESP * E * Cj / N_MP * M elements each way, and the MP all-gather of
      the decoded T x M rows (AG_MP(BLM)) after the pipeline (its backward: the split's all-gather).
    - S2 (Eq. 14): the same all-to-alls on the MP-split slots; the combine adds the MP all-gather of
      E * Cj * M, in series (``linear``) or overlapped with the all-to-all (``saa``).
    The shards (E / N_EP local experts, N_EP = W / N_ESP) run W * Cj / N_MP rows on H / N_ESP
    hidden units. Unpipelined and without the experts, the two are Algorithm 1's t_D1 and t_D2.
    ``esp_size`` None: N_ESP = N_MP."""

    name: str
    mp_size: int
    sends_tokens: bool = True
    esp_size: int | None = None

    @property
    def esp(self) -> int:
        return shard_count(self.mp_size, self.esp_size)

    @property
    def schedules(self) -> tuple[str, ...]:
        return ("s1", "s2") if self.name == "parm" else (self.name,)

    def closed_form(self, cost: CostModel, shape: RegionShape) -> ParmChoice:
        """Parm's Algorithm 1: S1 when t_D1 <= t_D2, the two schedules' communication of one
        unpipelined forward from the α-β fits (§V-B). t_D1 = 2 A2A(y1) + AG_MP(T M / N_MP): S1's
        all-to-alls of the member's own slots and the all-gather of the decoded tokens;
        t_D2 = A2A(y2) + Overlap(y2): S2's all-to-all and its combine overlapped with the MP
        all-gather (SAA's fit; the two in series where it is not calibrated). moeflow's S1 sends
        only occupied slots, so y1 <= y2 = N_ESP E C M / N_MP elements per member (the dump sends
        every slot to each of its expert's N_ESP shards)."""
        mp, element, model_dim = self.mp_size, shape.bytes_per_element, shape.dims.model_dim
        row = shape.dims.num_experts * model_dim * element  # one slot of every expert, in bytes
        y1, y2 = self.esp * self._own_slots(shape) * row, self.esp * -(-shape.capacity // mp) * row
        gathered = -(-shape.tokens // mp) * model_dim * element
        t_d1 = 2 * cost.t_alltoall("linear", y1) + cost.t_allgather(gathered, mp, intra_node=True)
        t_d2 = cost.t_alltoall("linear", y2) + cost.t_saa(y2, mp)
        return ParmChoice("s1" if t_d1 <= t_d2 else "s2", t_d1, t_d2)

    def can_predict(self, cost: CostModel) -> bool:
        return all(fit in cost.profile.fits for fit in ("gemm", "alltoall.linear", "allgather"))

    def forced_plan(self, degree: int, algorithm: str) -> Plan | None:
        if len(self.schedules) > 1:
            return None
        combine = algorithm if self.name == "s2" and algorithm in PARM_COMBINES else "linear"
        return Plan(self.name, degree, combine)

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]:
        """The plans of S1 and S2 (of the one named). For "parm" with a calibrated ``cost``, only
        those of Algorithm 1's choice: the closed form decides before any trial, and the planner's
        online timing only picks the degree (without a profile it times both schedules)."""
        degrees, combines = tuple(degrees), [a for a in algorithms if a in PARM_COMBINES] or ["linear"]
        plans = [Plan("s1", d, "linear") for d in usable_degrees(degrees, self._own_slots(shape))]
        plans += [Plan("s2", d, a) for a in combines for d in usable_degrees(degrees, shape.capacity)]
        schedules = self.schedules
        if len(schedules) > 1 and cost is not None and self.can_predict(cost):
            schedules = (self.closed_form(cost, shape).schedule,)
        return [plan for plan in plans if plan.schedule in schedules]

    def _own_slots(self, shape: RegionShape) -> int:
        """S1's packed capacity under a balanced split: each member's tokens hold 1 / N_MP of the
        occupied slots (S1 sends no empty slot, S2 sends its share of all of them)."""
        return max(1, -(-shape.occupied // self.mp_size))

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        mp, element, model_dim = self.mp_size, shape.bytes_per_element, shape.dims.model_dim
        row = shape.dims.num_experts * model_dim * element  # one slot of every expert, in bytes
        chunks, serial = [], 0.0
        if plan.schedule == "s1":
            for start, stop in capacity_chunks(self._own_slots(shape), plan.degree):
                a2a = cost.t_alltoall("linear", self.esp * (stop - start) * row)
                chunks.append((a2a, a2a, shape.world_size * (stop - start)))
            serial = cost.t_allgather(-(-shape.tokens // mp) * model_dim * element, mp, intra_node=True)
        else:
            for start, stop in capacity_chunks(shape.capacity, plan.degree):
                part = -(-(stop - start) // mp)
                a2a = cost.t_alltoall("linear", self.esp * part * row)
                combine = (
                    cost.t_saa(self.esp * part * row, mp) if plan.algorithm == "saa"
                    else a2a + cost.t_allgather(part * row, mp, intra_node=True)
                )
                chunks.append((a2a, combine, shape.world_size * part))
        return _shard_pipeline_prediction(plan, cost, shape, self.esp, chunks, backward, serial)


@dataclass(frozen=True)
class BaselineModel:
    """Parm Eq. 1 per chunk in PipeMoE's recurrence: dispatch = ESP all-gather of N copies plus the
    EP all-to-all of N * E * Cj * M elements; combine = the ESP all-reduce of the partials plus the
    all-to-all back; the shards run N copies: N_EP * N * Cj rows on H / N hidden units."""

    name: str = "ds-baseline"
    mp_size: int = 2
    sends_tokens: bool = True

    def can_predict(self, cost: CostModel) -> bool:
        return all(fit in cost.profile.fits for fit in ("gemm", "alltoall.linear", "allgather", "allreduce"))

    def forced_plan(self, degree: int, algorithm: str) -> Plan | None:
        return Plan(self.name, degree, "linear")

    def candidates(
        self, shape: RegionShape, degrees: Iterable[int], algorithms: Iterable[str], cost: CostModel | None = None
    ) -> list[Plan]:
        return [Plan(self.name, d, "linear") for d in usable_degrees(degrees, shape.capacity)]

    def predict(self, plan: Plan, cost: CostModel, shape: RegionShape, backward: bool) -> PlanPrediction:
        n, element, world = self.mp_size, shape.bytes_per_element, shape.world_size
        ep = world // n
        moved = (ep - 1) / ep * world / max(1, world - 1)  # EP group's share of the world fit's traffic
        chunks = []
        for start, stop in capacity_chunks(shape.capacity, plan.degree):
            buffer = shape.dims.num_experts * (stop - start) * shape.dims.model_dim * element
            a2a = cost.t_alltoall("linear", n * buffer * moved) if ep > 1 else 0.0
            dispatch, combine = cost.t_allgather(buffer, n) + a2a, cost.t_allreduce(n * buffer) + a2a
            chunks.append((dispatch, combine, world * (stop - start)))
        return _shard_pipeline_prediction(plan, cost, shape, n, chunks, backward)


def _shard_pipeline_prediction(
    plan: Plan, cost: CostModel, shape: RegionShape, mp: int, chunks: list[tuple[float, float, int]],
    backward: bool, serial_s: float = 0.0,
) -> PlanPrediction:
    """PipeMoE's recurrence over chunks of (dispatch s, combine s, rows each hidden shard runs),
    with the shards' FFN (H / N_MP hidden units, E / N_EP local experts) from the calibrated fits,
    plus ``serial_s`` outside the pipeline in each pass."""
    layer = shape.dims
    local = layer.num_experts // (shape.world_size // mp)
    slowdown = cost.profile.interference if plan.degree > 1 else 1.0
    dispatch = [d for d, _, _ in chunks]
    combine = [c for _, c, _ in chunks]
    dims = [(rows, layer.model_dim, layer.hidden_dim // mp, layer.projections) for _, _, rows in chunks]
    expert = [local * cost.t_ffn(*d) * slowdown for d in dims]
    forward = serial_s + pipeline_makespan(dispatch, expert, combine)
    back = 0.0
    if backward:
        expert_back = [local * cost.t_ffn(*d, backward=True) * slowdown for d in dims]
        back = serial_s + pipeline_makespan(dispatch, expert_back, combine)
    memory = local * layer.expert_parameters * shape.bytes_per_element // mp
    return PlanPrediction(plan.degree, plan.algorithm, forward, back, 0.0, memory, plan.schedule)
