"""The layer planner's candidates ranked by the simulator on the calibrated profile's twin.

``pipeline="auto"`` times only the top few candidates online; with a profile whose twin can be
built (the calibration's all-to-all and FFN fits), the order comes from simulating each plan's
region (dispatch, experts, combine, and the backward's when it has one) on that twin: the same
simulator and twin as ``moeflow plan --cluster`` and ``bench simulator``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from moeflow.config import DEDUP, DTYPE_BYTES, EXACT_WIRE, PADDED, ragged_min_saving
from moeflow.parallel.registry import SIMULATED
from moeflow.perf.schedule_models import ragged_shape
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.plan import StepPlan, simulated_algorithm
from moeflow.perf.sim.workload import ModelSpec
from moeflow.sim.calibrated import cluster_from_profile
from moeflow.sim.step import simulate_step

if TYPE_CHECKING:
    from moeflow.perf.profile import ClusterProfile
    from moeflow.perf.schedule_models import Plan
    from moeflow.perf.shape import RegionShape

DTYPE_OF_BYTES = {size: name for name, size in reversed(DTYPE_BYTES.items())}  # 2 bytes: bf16


def region_model(shape: RegionShape) -> ModelSpec:
    """One layer whose uniform routing fills exactly ``shape.capacity`` slots of every expert
    (top-1, f = 1, T = C x E tokens per rank). The region's dims without biases: the simulator
    has always priced an expert's weights alone (what the adaptive schedule gathers)."""
    dims = replace(shape.dims, top_k=1, bias=False)
    return ModelSpec(name="region", layers=1, dims=dims, capacity_factor=1.0,
                     tokens_per_rank=max(1, shape.capacity) * dims.num_experts,
                     dtype=DTYPE_OF_BYTES.get(shape.bytes_per_element, "fp32"))


def step_plan(plan: Plan, wire_dtype: str = EXACT_WIRE, top_k: int = 1) -> StepPlan | None:
    """The simulator's plan for a layer plan whose rows travel as ``wire_dtype`` (a dedup plan's
    all-to-alls deduplicating the ``top_k`` choices of a token), or None for a schedule it does not model."""
    if plan.schedule not in SIMULATED:
        return None
    algorithm = simulated_algorithm(plan.algorithm)
    if SIMULATED[plan.schedule].takes_r:
        return StepPlan(schedule=plan.schedule, r=plan.r, degree=plan.degree, algorithm=algorithm,
                        wire_dtype=wire_dtype)
    return StepPlan(schedule=plan.schedule, degree=plan.degree, algorithm=algorithm,
                    ragged_exchange=plan.exchange != PADDED, ragged_min_saving=ragged_min_saving(plan.exchange),
                    wire_dtype=wire_dtype, dedup_top_k=top_k if plan.exchange == DEDUP else None)


class SimulatedRanker:
    """Ranks a layer's candidate plans on one cluster's twin."""

    def __init__(self, twin: Cluster) -> None:
        self.twin = twin

    @classmethod
    def from_profile(cls, profile: ClusterProfile) -> SimulatedRanker | None:
        """None when the profile cannot make a twin (no all-to-all or FFN fits)."""
        try:
            return cls(cluster_from_profile(profile))
        except ValueError:
            return None

    def rank(self, shape: RegionShape, plans: list[Plan], backward: bool) -> list[tuple[Plan, float]] | None:
        """Every plan with its simulated seconds, fastest first (fewer chunks on ties); None when the
        twin's ranks are not the layer's or a plan's schedule is not simulated. A ragged plan's
        region is the kept rows' (:func:`~moeflow.perf.schedule_models.ragged_shape`)."""
        if shape.world_size != self.twin.world_size or not plans:
            return None
        ranked = []
        for plan in plans:
            simulated = step_plan(plan, shape.wire_dtype, shape.dims.top_k)
            if simulated is None:
                return None
            model = region_model(ragged_shape(shape) if plan.exchange != PADDED else shape)
            try:
                seconds = simulate_step(self.twin, model, simulated, training=backward, layer_only=True).step_s
            except ValueError:  # a layout the simulated schedule rejects
                return None
            ranked.append((plan, seconds))
        return sorted(ranked, key=lambda item: (item[1], item[0].degree))
