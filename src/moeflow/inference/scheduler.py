"""Lina's two-phase inference scheduler (§5.2): a placement per MoE layer per batch.

One :class:`InferenceScheduler` serves a model; each MoE layer gets a :class:`LayerScheduling`
(its hook) and calls it three times per forward: ``estimate`` before its gate (this rank's tokens'
expected selections from their paths so far, Eq. 1), ``routed`` after it (the path grows by the
token's first choice) and ``placement`` once every rank's counts and estimates are gathered (they
ride on the layer's existing all-gather of routing counts, as Lina piggybacks them on its
all-to-all). Phase 1 places the experts from the estimate; phase 2 re-places them from the gate's
counts only when the estimate's top experts differ from the gate's.

Schedules: ``lina`` (estimate, then phase 2), ``oracle`` (the gate's counts, no estimate: the
paper's "without estimation"), ``ideal`` (a gate forced to a balanced selection, experts in place:
the paper's lower bound; it changes the outputs and is for timing only) and ``unpadded`` (the
expert-parallel placement, but moved like the others: unequal splits, no capacity padding; what the
placement adds is lina's gain over it). ``static`` is the layer's own placement and needs no
scheduler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from moeflow.config import LayerDims
from moeflow.core.routing.selection import ExpertChoice
from moeflow.core.stats import max_over_mean
from moeflow.inference.assignment import (
    MAX_EXPERTS_PER_RANK,
    assignment_placement,
    check_max_experts_per_rank,
    popularity_placement,
    replica_slot_assignment,
)
from moeflow.inference.cost import PlanPrice, ReplicaPrices
from moeflow.inference.paths import MIN_PATH_TOKENS, PATH_LENGTH, RoutingProfile
from moeflow.parallel.expert_fetch import ExpertFetch, fetches
from moeflow.parallel.inference_hook import Fetch
from moeflow.parallel.placement import ExpertPlacement
from moeflow.parallel.redundant import rank_loads
from moeflow.perf.cost import CostModel

INFERENCE_SCHEDULES = ("static", "lina", "oracle", "ideal", "unpadded")
"""The inference schedules; all but ``static`` (the layer's own placement) run an :class:`InferenceScheduler`."""
COMPARE_TOP = 2  # Lina §7.3.2: the estimate is accurate when its top-2 experts are the gate's


@dataclass(frozen=True)
class SchedulerSettings:
    """How an :class:`InferenceScheduler` schedules: which schedule, the most experts a rank may
    host, the path length l of the estimate, how many top experts must agree with the gate's to
    skip phase 2, and the fewest profiled tokens a path needs to be used. ``replica_slots`` R, a
    memory budget: each rank keeps its own experts and computes at most R copies of others
    (:func:`~moeflow.inference.assignment.replica_slot_plan`); None: Lina's replicate-then-pack
    placement over ``max_experts_per_rank``."""

    schedule: str = "lina"
    max_experts_per_rank: int = MAX_EXPERTS_PER_RANK
    path_length: int = PATH_LENGTH
    compare_top: int = COMPARE_TOP
    min_path_tokens: int = MIN_PATH_TOKENS
    replica_slots: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in INFERENCE_SCHEDULES[1:]:
            raise ValueError(f"schedule must be one of {INFERENCE_SCHEDULES[1:]} (static needs no scheduler), "
                             f"got {self.schedule!r}")
        for name in ("path_length", "compare_top", "min_path_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.replica_slots is not None and (not isinstance(self.replica_slots, int) or self.replica_slots < 0):
            raise ValueError(f"replica_slots must be an integer >= 0 (None: no budget), got {self.replica_slots!r}")

    def placement(self, load_E: np.ndarray, world_size: int, hidden_dim: int,
                  price: PlanPrice | None = None) -> ExpertPlacement:
        """Where the experts run for ``load_E``: within the replica budget (copies made while they
        lower ``price``, a cost model's seconds of the layer under a plan), or Lina's packing."""
        if self.replica_slots is None:
            return popularity_placement(load_E, world_size, hidden_dim, self.max_experts_per_rank)
        slots = self.replica_slots if price is None or price.copies_may_pay else 0
        plan = replica_slot_assignment(load_E, world_size, slots, price)
        return assignment_placement(plan, len(load_E), hidden_dim)


@dataclass(frozen=True)
class LayerRecord:
    """One MoE layer of one forward: the load, the estimate, the phase and the placement used."""

    layer: int
    load: list[int]  # kept selections per expert, all ranks
    estimate: list[float] | None
    accurate: bool | None  # the estimate's top experts are the gate's (lina only)
    phase: int  # 1: the estimate's placement ran; 2: re-placed from the gate's counts; 0: no estimate
    plan: list[list[int]]  # experts of each rank
    rank_tokens: list[float]  # each rank's share of the load under the plan
    fetched: int = 0  # experts copied from where the layer stores them, for this forward
    early: int = 0  # copies fetched a layer ahead (phase 1), used or not
    late: int = 0  # copies fetched on the critical path (phase 2, layer 0, or no layer ahead)

    @property
    def held(self) -> int:
        """The most experts one rank holds in this forward (its own and the copies)."""
        return max(map(len, self.plan), default=0)

    @property
    def skew(self) -> float:
        """max / mean expert load."""
        return max_over_mean(self.load)

    def to_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "skew": self.skew, "held": self.held,
                "rank_skew": max_over_mean(self.rank_tokens)}


def top_experts(load_E: np.ndarray, count: int) -> frozenset[int]:
    """The ``count`` most loaded experts (ties: the lower id)."""
    return frozenset(np.argsort(-np.asarray(load_E, dtype=np.float64), kind="stable")[:count].tolist())


def balanced_choice(choice: ExpertChoice, num_experts: int, rank: int) -> ExpertChoice:
    """The ideal gate: token t's k choices are experts (t k + j + rank k) mod E, an equal share each."""
    tokens, top_k = choice.expert_idx_TK.shape
    index = torch.arange(tokens * top_k, device=choice.expert_idx_TK.device).view(tokens, top_k)
    return dataclasses.replace(choice, expert_idx_TK=(index + rank * top_k) % num_experts)


@dataclass(frozen=True)
class AttachedLayer:
    """What the scheduler knows of a layer to place it a layer ahead: how to start fetching its
    experts' weights, where they are stored, and (with a cost model) what a plan costs there."""

    fetch: Fetch
    storage: ExpertPlacement
    prices: ReplicaPrices | None = None
    hides_copies: bool = False  # copies move while this layer computes without slowing it (a GPU)


@dataclass(frozen=True)
class Ahead:
    """A layer's phase 1, decided at the layer before: every rank's estimate summed, the placement
    and the fetch of its copies (posted; None: the layer fetches them itself)."""

    estimate_E: np.ndarray
    placement: ExpertPlacement
    fetch: ExpertFetch | None

    def fetched(self, fetch: Fetch) -> ExpertFetch:
        """The placement's weights: posted a layer ahead, or fetched now with ``fetch``."""
        return self.fetch or fetch(self.placement)


@dataclass
class InferenceScheduler:
    """The scheduler of one model's MoE layers (their forward order is their index). ``cost``, a
    calibrated profile's cost model: under a replica budget, a copy is made only where it pays
    (:mod:`moeflow.inference.cost`); None: wherever it unloads the busiest rank."""

    settings: SchedulerSettings
    num_layers: int
    profile: RoutingProfile | None = None
    keep_routes: bool = False  # keep every token's choices (profiling): ``routes``, one (T, layers, k) per forward
    cost: CostModel | None = None
    records: list[LayerRecord] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    _layer_routes: list[np.ndarray] = field(default_factory=list)
    _history: list[np.ndarray] = field(default_factory=list)  # first choices of this forward's tokens
    _attached: dict[int, AttachedLayer] = field(default_factory=dict)
    _ahead: dict[int, Ahead] = field(default_factory=dict)  # phase 1 of the layers ahead, in flight

    def __post_init__(self) -> None:
        if self.settings.schedule == "lina" and self.profile is None:
            raise ValueError("schedule='lina' estimates from a routing profile: pass profile= (moeflow "
                             "profile-routing records one)")

    def hook(self, layer: int) -> LayerScheduling:
        return LayerScheduling(self, layer)

    def attach(self, layer: int, fetch: Fetch, storage: ExpertPlacement, dims: LayerDims, element_bytes: int,
               hides_copies: bool = False) -> None:
        """Let the layer before ``layer`` fetch its copies ahead (``fetch`` from ``storage``), and
        price its plans for ``dims`` in ``element_bytes`` when there is a cost model.
        ``hides_copies``: the copies fetched while ``layer`` computes cost it nothing (its device
        moves them on their own engine, as a GPU; a CPU rank's core moves them itself)."""
        prices = None if self.cost is None else ReplicaPrices.from_cost_model(self.cost, dims, element_bytes)
        self._attached[layer] = AttachedLayer(fetch, storage, prices, hides_copies)

    def start_forward(self) -> None:
        """A forward begins at layer 0: fetches left in flight by one that stopped early complete
        (every rank posted them) and are dropped."""
        for ahead in self._ahead.values():
            if ahead.fetch is not None:
                ahead.fetch.wait()
        self._ahead.clear()
        self._history.clear()
        self._layer_routes.clear()

    def pricing(self, layer: int, load_E: np.ndarray, hidden_s: float = 0.0) -> PlanPrice | None:
        """The cost model's seconds of ``layer`` under a plan for ``load_E``, its copies' time
        beyond ``hidden_s``; None without a cost model (or with no price for that layer)."""
        attached = self._attached.get(layer)
        if attached is None or attached.prices is None:
            return None
        storage = attached.storage.experts_per_rank()
        return PlanPrice(attached.prices, np.asarray(load_E, dtype=np.float64), storage, hidden_s)

    def hiding_seconds(self, layer: int, placement: ExpertPlacement, load_E: np.ndarray) -> float:
        """The link time a fetch started at ``layer`` hides under: its predicted expert compute
        under ``placement`` where its device hides copies, else (or without a cost model) 0."""
        attached = self._attached.get(layer)
        if attached is None or attached.prices is None or not attached.hides_copies:
            return 0.0
        return attached.prices.compute_seconds(placement.experts_per_rank(), load_E)

    def take_records(self) -> list[LayerRecord]:
        """The records since the last call (one per layer per forward)."""
        taken, self.records = self.records, []
        return taken

    def check_layer(self, num_experts: int, world_size: int) -> None:
        if world_size == 1:
            return
        if self.settings.replica_slots is None:
            check_max_experts_per_rank(self.settings.max_experts_per_rank, num_experts, world_size)
        elif num_experts % world_size:
            raise ValueError(f"replica_slots keeps each worker's own experts: {num_experts} experts must split "
                             f"evenly over the {world_size} workers (or leave replica_slots unset)")


@dataclass(frozen=True)
class LayerScheduling:
    """One MoE layer's hook into its :class:`InferenceScheduler` (see the module docstring)."""

    scheduler: InferenceScheduler
    layer: int

    @property
    def settings(self) -> SchedulerSettings:
        return self.scheduler.settings

    def routed(self, choice: ExpertChoice, num_experts: int, rank: int) -> ExpertChoice:
        """The gate's choice (the ideal gate's instead), the first choices appended to the path."""
        if self.settings.schedule == "ideal":
            choice = balanced_choice(choice, num_experts, rank)
        scheduler, choices_TK = self.scheduler, choice.expert_idx_TK.to("cpu", torch.long).numpy()
        if self.layer == 0:
            scheduler.start_forward()
        scheduler._history.append(choices_TK[:, 0])
        if scheduler.keep_routes:
            scheduler._layer_routes.append(choices_TK)
            if len(scheduler._layer_routes) == scheduler.num_layers:
                scheduler.routes.append(np.stack(scheduler._layer_routes, axis=1))
        return choice

    def estimate(self, num_tokens: int) -> np.ndarray | None:
        """After the gate (lina): this rank's expected selections per expert at the next layer, from
        the paths so far (and at layer 0 its own, from the layer's popularity alone)."""
        profile, scheduler = self.scheduler.profile, self.scheduler
        if self.settings.schedule != "lina" or profile is None:
            return None
        history = scheduler._history
        if len(history) != self.layer + 1 or any(h.shape[0] != num_tokens for h in history):
            raise RuntimeError(f"MoE layer {self.layer} ran before the layers ahead of it in this forward "
                               "(the scheduler needs every MoE layer called once per forward, in order)")
        path_TI = np.stack(history, axis=1)
        layers = ([0] if self.layer == 0 else []) + ([self.layer + 1] if self.layer + 1 < scheduler.num_layers else [])
        estimates = [profile.estimate(layer, path_TI[:, :layer], profile.top_k, self.settings.min_path_tokens,
                                      self.settings.path_length) for layer in layers]
        return np.concatenate(estimates) if estimates else None

    def placement(
        self, load_E: torch.Tensor, estimate: np.ndarray | None, storage: ExpertPlacement, fetch: Fetch
    ) -> ExpertFetch:
        """Phase 1 (decided a layer ahead, its copies already on the way) when the estimate's top
        experts are the gate's, else phase 2 from ``load_E`` (every rank's kept selections); then,
        from ``estimate``, phase 1 of the next layer, whose copies start moving now."""
        world_size, hidden_dim = len(storage.shards), storage.hidden_dim
        load = load_E.to("cpu", torch.long).numpy()
        settings, ahead, accurate = self.settings, None, None
        if settings.schedule in ("ideal", "unpadded") and len(load) % world_size == 0:
            placed = fetch(ExpertPlacement.expert_parallel(len(load), world_size, hidden_dim))
        elif settings.schedule == "lina":
            ahead, estimate = self._phase_one(estimate, len(load), storage)
            accurate = top_experts(ahead.estimate_E, settings.compare_top) == top_experts(load, settings.compare_top)
            placed = ahead.fetched(fetch) if accurate else self._phase_two(load, ahead, storage, fetch)
            self._plan_next(estimate, placed, load)
        else:
            placed = fetch(settings.placement(load, world_size, hidden_dim, self.scheduler.pricing(self.layer, load)))
        self.scheduler.records.append(self._record(load, ahead, accurate, placed))
        return placed

    def _phase_one(self, carried: np.ndarray | None, num_experts: int,
                   storage: ExpertPlacement) -> tuple[Ahead, np.ndarray | None]:
        """This layer's phase 1 (at layer 0 planned now from the carried estimate, whose rest is
        the next layer's) and the next layer's estimate."""
        if self.layer > 0:
            ahead = self.scheduler._ahead.pop(self.layer, None)
            if ahead is None:
                raise RuntimeError(f"MoE layer {self.layer} has no phase-1 placement: the layer before it did not "
                                   "run in this forward (call every MoE layer once per forward, in order)")
            return ahead, carried
        assert carried is not None  # lina's layer 0 always carries its own estimate
        estimate_E = carried[:num_experts]
        pricing = self.scheduler.pricing(0, estimate_E)
        placement = self.settings.placement(estimate_E, len(storage.shards), storage.hidden_dim, pricing)
        return Ahead(estimate_E, placement, None), carried[num_experts:] if len(carried) > num_experts else None

    def _phase_two(self, load: np.ndarray, ahead: Ahead, storage: ExpertPlacement, fetch: Fetch) -> ExpertFetch:
        """The estimate was wrong: the posted copies finish arriving and are dropped, and the
        gate's counts' placement fetches its copies on the critical path."""
        if ahead.fetch is not None:
            ahead.fetch.wait()
        pricing = self.scheduler.pricing(self.layer, load)
        return fetch(self.settings.placement(load, len(storage.shards), storage.hidden_dim, pricing))

    def _plan_next(self, estimate_E: np.ndarray | None, placed: ExpertFetch, load: np.ndarray) -> None:
        """Phase 1 of the next layer from its estimate; its copies move while this layer computes."""
        scheduler, upcoming = self.scheduler, self.layer + 1
        if estimate_E is None or upcoming >= scheduler.num_layers:
            return
        attached = scheduler._attached.get(upcoming)
        hidden_s = scheduler.hiding_seconds(self.layer, placed.placement, load)
        storage = placed.placement if attached is None else attached.storage
        placement = self.settings.placement(estimate_E, len(storage.shards), storage.hidden_dim,
                                            scheduler.pricing(upcoming, estimate_E, hidden_s))
        early = attached is not None and bool(fetches(attached.storage, placement))  # copies to move now
        scheduler._ahead[upcoming] = Ahead(estimate_E, placement, attached.fetch(placement) if early else None)

    def _record(self, load: np.ndarray, ahead: Ahead | None, accurate: bool | None,
                placed: ExpertFetch) -> LayerRecord:
        estimate_E = None if ahead is None else ahead.estimate_E
        early = 0 if ahead is None or ahead.fetch is None else ahead.fetch.copies
        late = 0 if ahead is not None and placed is ahead.fetch else placed.copies
        return LayerRecord(
            self.layer, load.tolist(), None if estimate_E is None else [float(v) for v in estimate_E], accurate,
            0 if ahead is None else (1 if accurate else 2),
            placed.placement.experts_per_rank(),
            rank_loads(placed.placement, load.tolist()), placed.copies, early, late,
        )


def summarize_records(records: list[LayerRecord]) -> dict[str, object]:
    """Per layer and overall: forwards, the estimate's accuracy, the phase-2 rate, the mean skew
    of the experts' load and of the ranks' load under the plans, and the plans used (with counts)."""
    layers: dict[int, list[LayerRecord]] = {}
    for record in records:
        layers.setdefault(record.layer, []).append(record)

    def stats(group: list[LayerRecord]) -> dict[str, object]:
        judged = [r.accurate for r in group if r.accurate is not None]
        return {
            "forwards": len(group),
            "accuracy": float(np.mean(judged)) if judged else None,
            "phase2_rate": float(np.mean([r.phase == 2 for r in group])) if judged else None,
            "skew": float(np.mean([r.skew for r in group])),
            "rank_skew": float(np.mean([max_over_mean(r.rank_tokens) for r in group])),
            "fetched_per_forward": float(np.mean([r.fetched for r in group])),
            "moved_per_forward": float(np.mean([r.early + r.late for r in group])),
            "late_per_forward": float(np.mean([r.late for r in group])),
            "max_experts_held": max(r.held for r in group),
        }

    per_layer = []
    for layer, group in sorted(layers.items()):
        plans: dict[str, int] = {}
        for record in group:
            key = "|".join(",".join(map(str, rank)) for rank in record.plan)
            plans[key] = plans.get(key, 0) + 1
        per_layer.append({"layer": layer, **stats(group), "plans": plans})
    return {**(stats(records) if records else {"forwards": 0}), "layers": per_layer}
