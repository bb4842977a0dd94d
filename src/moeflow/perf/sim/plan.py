"""The knobs of one simulated step (:class:`StepPlan`), checked on their own. Which schedule a plan
names, and whether the cluster can run it, is the technique's record's to check
(:func:`moeflow.sim.step.technique_of`): this module imports no record, so the regions that
write plans and the builder that reads them stay below the registry."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeflow.config import ALLTOALL_ALGORITHMS, EXACT_WIRE, WIRE_DTYPES, require_choice
from moeflow.perf.sim.network import ALLREDUCE_ALGORITHMS


@dataclass(frozen=True)
class StepPlan:
    """The knobs of one step: parallel schedule (with Tutel's ``r`` for the schedules that take
    one), pipeline degree and all-to-all algorithm, the hottest experts FasterMoE shadows per
    layer, the gradient all-reduce's algorithm, whether all-to-alls take the links first (Lina), and
    for the schedules behind tensor-parallel attention (Parm's) the tensor-parallel (``mp``) and
    expert-sharding (``esp``) group sizes."""

    schedule: str = "expert"
    degree: int = 1
    algorithm: str = "linear"
    allreduce: str = "auto"
    prioritize_alltoall: bool = False
    r: int | None = None
    shadowed: int = 0
    bucket_mb: float = 0.0  # gradients all-reduced in buckets of this many MB (DDP: 25); 0: per layer; inf: after
    mp: int = 1  # N_MP: attention split over this many consecutive ranks (Megatron), Parm's schedules only
    esp: int = 1  # N_ESP: each expert's hidden dimension sharded over this many consecutive ranks
    padded_backward: bool = False  # dropless backward on the padded buffer (moeflow's CPU ragged kernel until 11-26)
    shadowed_slots_travel: bool = False  # shadowed experts' slots stay in the exchange, cut (moeflow's shadowing)
    packed_s1: bool = False  # S1 sends only its occupied slots (moeflow's S1; Parm's sends 1 / N_MP of the capacity)
    ragged_exchange: bool = False  # the expert exchange sends only kept rows (moeflow's token_exchange='ragged')
    ragged_min_saving: float = 0.0  # a chunk travels ragged only with this share of its slots empty ('auto')
    dedup_top_k: int | None = None  # token_exchange='dedup' at this k: a token once to each rank (2DH: each node)
    wire_dtype: str = EXACT_WIRE  # how the expert exchange's rows travel (moeflow.config.wire_row_bytes)
    redundant_slots: int = 0  # EPLB: this many extra expert slots, placed for each layer's load
    ep: int | None = None  # experts over groups of this many consecutive ranks, copied world / ep times; None: all

    def __post_init__(self) -> None:
        for name in ("degree", "shadowed", "mp", "esp", "redundant_slots"):
            value, least = getattr(self, name), 0 if name in ("shadowed", "redundant_slots") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.ep is not None and (isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1):
            raise ValueError(f"ep must be None (every rank) or an integer >= 1, got {self.ep!r}")
        if self.algorithm not in ALLTOALL_ALGORITHMS:
            raise ValueError(
                f"all-to-all algorithm must be one of {', '.join(ALLTOALL_ALGORITHMS)}, got {self.algorithm!r}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, int | float) or self.bucket_mb < 0:
            raise ValueError(f"bucket_mb must be a number >= 0 (0: one all-reduce per layer), got {self.bucket_mb!r}")
        if self.allreduce not in (*ALLREDUCE_ALGORITHMS, "auto"):
            raise ValueError(f"all-reduce must be auto, ring or tree, got {self.allreduce!r}")
        require_choice("wire_dtype", self.wire_dtype, WIRE_DTYPES)
        if self.dedup_top_k is not None and not (isinstance(self.dedup_top_k, int) and self.dedup_top_k >= 1
                                                 and self.ragged_exchange):
            raise ValueError(f"dedup_top_k must be an integer >= 1 on a ragged exchange, got {self.dedup_top_k!r}")

    def options_label(self) -> str:
        """The label's tail that every schedule shares: the expert group, the exchange, shadowing,
        slots, priority."""
        return (f" ep={self.ep}" if self.ep is not None else "") + (" ragged" if self.ragged_exchange else "") + \
            (" dedup" if self.dedup_top_k is not None else "") + \
            (f" wire={self.wire_dtype}" if self.wire_dtype != EXACT_WIRE else "") + \
            (self.sync_label() if not self.prioritize_alltoall else "") + \
            (f" shadow={self.shadowed}" if self.shadowed else "") + \
            (f" slots+{self.redundant_slots}" if self.redundant_slots else "") + \
            (" prioritized" if self.prioritize_alltoall else "")


    def sync_label(self) -> str:
        """How the gradients are all-reduced, where it is not one all-reduce per layer."""
        if self.bucket_mb == math.inf:
            return " sync=after"
        return f" buckets={self.bucket_mb:g}MB" if self.bucket_mb else ""


def simulated_algorithm(name: str | None) -> str:
    """The all-to-all algorithm the simulator prices for a layer's: its own, or linear for the
    names it has no model of ("none": nothing sent; Parm's fused combines)."""
    return name if name in ALLTOALL_ALGORITHMS else "linear"
