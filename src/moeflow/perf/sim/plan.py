"""The knobs of one simulated step (:class:`StepPlan`), checked on their own. Which schedule a plan
names, and whether the cluster can run it, is the technique's record's to check
(:func:`moeflow.sim.step.technique_of`): this module imports no record, so the regions that
write plans and the builder that reads them stay below the registry."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeflow.config import ALLTOALL_ALGORITHMS, EXACT_WIRE, WIRE_DTYPES, require_choice
from moeflow.perf.sim.network import ALLREDUCE_ALGORITHMS
from moeflow.perf.stage_schedule import OrderItem, Paired, actions_of, stage_orders


@dataclass(frozen=True)
class StepPlan:
    """The knobs of one step: parallel schedule (with Tutel's ``r`` for the schedules that take
    one), pipeline degree and all-to-all algorithm, the hottest experts FasterMoE shadows per
    layer, the gradient all-reduce's algorithm, whether all-to-alls take the links first (Lina), and
    for the schedules behind tensor-parallel attention (Parm's) the tensor-parallel (``mp``) and
    expert-sharding (``esp``) group sizes. With ``pp`` > 1 the step is pipelined: the blocks in
    stages over ``pp`` groups of world / pp consecutive ranks (``pp`` outermost, as ``moeflow train
    --pp-size``), run by ``pp_schedule`` over ``microbatches`` micro-batches (None: the schedule's
    stage count, the trainer's default), DualPipeV's pairs overlapped with ``pp_overlap``; the other
    knobs then describe one stage, and only those the pipelined trainer runs are accepted."""

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
    pp: int = 1  # pipeline stages over this many groups of world / pp consecutive ranks; 1: no pipeline
    pp_schedule: str = "1f1b"  # the pipeline's schedule: moeflow.perf.stage_schedule's names (the trainer's)
    microbatches: int | None = None  # micro-batches of a pipelined step; None: the schedule's stage count
    pp_overlap: bool = False  # dualpipev: each paired forward and backward hide each other's all-to-alls

    def __post_init__(self) -> None:
        for name in ("degree", "shadowed", "mp", "esp", "redundant_slots", "pp"):
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
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        """The pipeline's knobs: a schedule the simulator prices, enough micro-batches for its stages,
        and with ``pp`` > 1 only what the pipelined trainer runs (its ``NOT_WITH_PIPELINE``)."""
        if not isinstance(self.pp_overlap, bool):
            raise ValueError(f"pp_overlap must be True or False, got {self.pp_overlap!r}")
        _probe(self.pp_schedule)
        if self.pp == 1:
            if self.microbatches is not None or self.pp_overlap:
                raise ValueError("microbatches and pp_overlap split and overlap a pipelined step: set pp > 1, or "
                                 "leave microbatches None and pp_overlap False")
            return
        if self.pp_overlap and not schedule_pairs(self.pp_schedule):
            raise ValueError(f"pp_overlap overlaps the forward and backward DualPipeV pairs; pp_schedule="
                             f"{self.pp_schedule!r} pairs none: set pp_schedule='dualpipev' or pp_overlap=False")
        refused = [name for name, ok in (("mp", self.mp == 1), ("esp", self.esp == 1), ("shadowed", not self.shadowed),
                                         ("redundant_slots", not self.redundant_slots),
                                         ("prioritize_alltoall", not self.prioritize_alltoall),
                                         ("bucket_mb", self.bucket_mb == math.inf)) if not ok]
        if refused:
            raise ValueError(f"pp={self.pp}: the pipelined trainer runs mp 1, esp 1, no shadowing, no redundant slots "
                             f"and its gradient sync once after the pipeline drains (bucket_mb=inf); change "
                             f"{', '.join(refused)}, or set pp=1")
        stages = self.pipeline_stages
        microbatches = self.pipeline_microbatches
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < stages:
            raise ValueError(f"microbatches must be None or an integer >= the {stages} stages of pp_schedule="
                             f"{self.pp_schedule!r} over pp={self.pp}, got {self.microbatches!r}")
        try:
            stage_orders(self.pp_schedule, self.pp, microbatches)
        except ValueError as error:
            raise ValueError(f"microbatches={microbatches} with pp_schedule={self.pp_schedule!r}: {error}") from None

    @property
    def pipeline_stages(self) -> int:
        """The stages ``pp_schedule`` cuts the blocks into over ``pp`` ranks (``pp`` x its stages per rank)."""
        return schedule_stages(self.pp_schedule, self.pp)

    @property
    def pipeline_microbatches(self) -> int:
        """The micro-batches of a step: ``microbatches``, or the schedule's stage count (1 without a pipeline)."""
        if self.pp == 1:
            return 1
        return self.pipeline_stages if self.microbatches is None else self.microbatches

    def pipeline_label(self) -> str:
        """The label's tail that names the pipeline (empty without one)."""
        if self.pp == 1:
            return ""
        return f" pp={self.pp} {self.pp_schedule} m={self.pipeline_microbatches}" + \
            (" overlap" if self.pp_overlap else "")

    def options_label(self) -> str:
        """The label's tail that every schedule shares: the expert group, the exchange, shadowing,
        slots, priority."""
        return (f" ep={self.ep}" if self.ep is not None else "") + (" ragged" if self.ragged_exchange else "") + \
            (" dedup" if self.dedup_top_k is not None else "") + \
            (f" wire={self.wire_dtype}" if self.wire_dtype != EXACT_WIRE else "") + \
            (self.sync_label() if not self.prioritize_alltoall else "") + \
            (f" shadow={self.shadowed}" if self.shadowed else "") + \
            (f" slots+{self.redundant_slots}" if self.redundant_slots else "") + \
            (" prioritized" if self.prioritize_alltoall else "") + self.pipeline_label()

    def sync_label(self) -> str:
        """How the gradients are all-reduced, where it is not one all-reduce per layer."""
        if self.bucket_mb == math.inf:
            return " sync=after"
        return f" buckets={self.bucket_mb:g}MB" if self.bucket_mb else ""


def simulated_algorithm(name: str | None) -> str:
    """The all-to-all algorithm the simulator prices for a layer's: its own, or linear for the
    names it has no model of ("none": nothing sent; Parm's fused combines)."""
    return name if name in ALLTOALL_ALGORITHMS else "linear"


def schedule_stages(schedule: str, pp: int) -> int:
    """The stages ``schedule`` makes over ``pp`` ranks, read off the orders
    :mod:`moeflow.perf.stage_schedule` prices (those the trainer runs: one stage per rank, two
    looped for ``interleaved``, a V of two for ``zbv`` and ``dualpipev``; a test checks them
    against :mod:`moeflow.pipeline.layout`, which sits above the simulator)."""
    return 1 + max(action.stage for order in _probe(schedule, pp) for item in order for action in actions_of(item))


def schedule_pairs(schedule: str) -> bool:
    """Whether ``schedule`` pairs one micro-batch's forward with another's backward (DualPipeV's
    ``OVERLAP_F_B``, which ``pp_overlap`` overlaps)."""
    return any(isinstance(item, Paired) for order in _probe(schedule, 2) for item in order)


def _probe(schedule: str, pp: int = 1) -> list[list[OrderItem]]:
    """``schedule``'s orders over ``pp`` ranks at 2 pp micro-batches (enough for every schedule);
    a ValueError naming ``pp_schedule`` for a name the simulator does not price."""
    try:
        return stage_orders(schedule, pp, 2 * pp)
    except ValueError as error:
        raise ValueError(f"pp_schedule: {error}") from None
