"""Chooses the plan of one MoE layer per iteration: the schedule's pipeline degree d and all-to-all
algorithm (a :class:`~moeflow.perf.schedule_models.Plan`), ranked across schedules with one cost model.

Policies (``pipeline=``):

- ``"model"``: PipeMoE. Predict every (d, algorithm) with the event recurrences on the calibrated
  profile and take the fastest (cached per capacity).
- ``"search"``: Tutel 3.3. A dictionary keyed by floor(capacity / R): on a new key, each candidate
  of {1, 2, 4, 8} x algorithms runs for a few iterations, the median time of the slowest rank is
  kept (one untimed warm-up call comes first: the first call at a new capacity grows buffers and
  was always d=1's), and the best candidate serves that key afterwards: the one with the fewest chunks among
  those within ``min_gain`` (5 %) of the fastest. Trials are a few noisy medians, and a pipelined
  plan whose measured gain is inside that noise costs more than it saves (on two gloo ranks over
  loopback, trial noise picked d=2 or d=8 where d=1 ran 5-15 % faster).
- ``"auto"`` (default): the candidates are ranked and only the top few are timed online, as in
  ``search``. The ranking is the simulator's on the profile's twin (:mod:`moeflow.sim.layer_ranking`)
  where the profile can make one and the schedule is simulated, else the cost model's; without a
  usable profile ``auto`` is ``search``.
- an integer: that degree; the algorithm is still planned when ``alltoall="auto"``.

Every rank makes the same choice: decisions depend only on the capacity (agreed by all ranks) and
on times reduced with MAX over the group (``reduce_max``, which the layer passes in). No torch here:
the planner is plain bookkeeping over :mod:`moeflow.perf`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from moeflow.config import validate_pipeline
from moeflow.core.stats import PipelineTiming
from moeflow.perf import ClusterProfile, CostModel
from moeflow.perf.schedule_models import (
    LOCAL,
    MIN_GAIN,
    SMART,
    SMART_PLAN_ALGORITHM,
    ExpertParallelModel,
    Plan,
    ReplicatedModel,
    ScheduleModel,
    rank_schedule_plans,
)
from moeflow.perf.shape import RegionShape

SEARCH_DEGREES = (1, 2, 4, 8)
"""The pipeline degrees the online search times."""
MAX_MODEL_DEGREE = 16
"""The largest pipeline degree the cost model ranks."""
ReduceMax = Callable[[Sequence[float]], list[float]]


@dataclass(frozen=True)
class PlanChoice:
    """The plan of one forward and why: ``source`` is forced, model, warmup, trial, dictionary or local."""

    plan: Plan
    source: str
    key: int | None = None
    predicted_forward_s: float | None = None
    predicted_backward_s: float | None = None
    predicted_gradient_sync_s: float | None = None


@dataclass
class _Search:
    candidates: list[Plan]
    trials: int
    timings: list[list[PipelineTiming]] = field(default_factory=list)
    issued: int = 0
    held_back: list[Plan] = field(default_factory=list)  # plans of Tutel r's the ternary search may add
    interior_rs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.timings = [[] for _ in self.candidates]

    def add(self, plans: list[Plan]) -> None:
        self.candidates.extend(plans)
        self.timings.extend([] for _ in plans)

    def next_trial(self) -> int | None:
        if self.issued >= len(self.candidates) * self.trials:
            return None
        index = self.issued // self.trials
        self.issued += 1
        return index


class PlanRanker(Protocol):
    """Ranks candidate plans by predicted time (the simulator's twin of the profile, built by the
    factory the layer passes in: the planner imports no simulator)."""

    def rank(self, shape: RegionShape, plans: list[Plan], backward: bool) -> list[tuple[Plan, float]] | None: ...


class OnlinePlanner:
    """One per layer: owns the dictionary of best plans and the trials in progress.

    ``schedule`` is the model of the schedule whose plans are ranked (the layer's placement fixes
    it; an ``adaptive`` one adds Tutel's r to each plan), or its name; ``reduce_max`` is None for
    one process (nothing to plan: the degree runs locally).
    """

    def __init__(
        self,
        degree_policy: int | str,
        algorithms: tuple[str, ...],
        cost_model: CostModel | None,
        reduce_max: ReduceMax | None,
        capacity_bucket: int = 128,
        search_trials: int = 3,
        top_candidates: int = 3,
        schedule: ScheduleModel | None = None,
        min_gain: float = MIN_GAIN,
        ranker: Callable[[ClusterProfile], PlanRanker | None] | None = None,
    ) -> None:
        validate_pipeline(degree_policy)
        self.reduce_max = reduce_max
        self.model = schedule if schedule is not None else ExpertParallelModel()
        self.schedule = self.model.name
        if not self.model.sends_tokens:
            algorithms = (LOCAL,)
        modelled = _modelled_algorithms(cost_model, algorithms)
        if cost_model is not None and not self.model.can_predict(cost_model):
            modelled = ()
        self._predictor = cost_model if modelled else None  # predictions for the stats
        self.cost_model = cost_model if modelled and degree_policy != "search" else None  # ranks plans
        if self.cost_model is not None:
            algorithms = modelled  # the model can only rank what the profile measured
        if degree_policy == "model" and self.cost_model is None:
            raise ValueError(
                "pipeline='model' needs a calibrated profile with the gemm fit and an all-to-all fit for "
                f"{' or '.join(algorithms)}; pass profile=... (create one with `moeflow calibrate`) "
                "or use pipeline='search'"
            )
        self.degree_policy = degree_policy  # the setting `pipeline`: a degree or how to choose one
        self.algorithms = algorithms
        self.capacity_bucket = capacity_bucket
        self.search_trials = search_trials
        self.top_candidates = top_candidates
        self.min_gain = min_gain
        # under "auto", the simulator's ranking on the profile's twin (``ranker`` builds it) orders the trials
        self._simulator = None
        if ranker is not None and degree_policy == "auto" and self.cost_model is not None:
            self._simulator = ranker(self.cost_model.profile)
        self.dictionary: dict[int, Plan] = {}
        self.measured: dict[int, dict[Plan, float]] = {}  # key -> slowest-rank median per candidate
        self._searches: dict[int, _Search] = {}
        self._model_cache: dict[tuple[RegionShape, bool], Plan] = {}

    def choose(self, shape: RegionShape, backward: bool, r: int | None = None) -> tuple[PlanChoice, PipelineTiming]:
        """The plan for this forward, and the timing record its execution must fill; ``r`` forces
        Tutel's r for this call (the degree is then the forced one, or 1, on the first algorithm)."""
        timing = PipelineTiming()
        degree = self.degree_policy if isinstance(self.degree_policy, int) else 1
        if r is not None:
            plan = Plan(self.schedule, degree, self.algorithms[0], r) if r else Plan(self.schedule, 1, LOCAL, 0)
            return self._with_prediction(plan, "forced", None, shape, backward), timing
        if self.reduce_max is None or not self.model.sends_tokens:  # nothing is sent: nothing to plan
            local = self.model.forced_plan(degree, LOCAL) or Plan(self.schedule, degree, LOCAL, 1)
            return self._with_prediction(local, "local", None, shape, backward), timing
        if self.degree_policy == SMART:
            return self._with_prediction(Plan(SMART, 1, SMART_PLAN_ALGORITHM), "forced", None, shape, backward), timing
        degrees = (self.degree_policy,) if isinstance(self.degree_policy, int) else None
        forced = self.model.forced_plan(degree, self.algorithms[0])
        if forced is not None and (forced.algorithm == LOCAL or (degrees is not None and len(self.algorithms) == 1)):
            return self._with_prediction(forced, "forced", None, shape, backward), timing
        if self.degree_policy == "model":
            return self._with_prediction(self._model_choice(shape, backward), "model", None, shape, backward), timing

        key = shape.capacity // self.capacity_bucket
        if key in self.dictionary:
            return self._with_prediction(self.dictionary[key], "dictionary", key, shape, backward), timing
        search = self._searches.get(key)
        if search is None:  # the first call at a new key pays one-time costs: run it untimed
            search = self._new_search(self._candidates(shape, backward, degrees))
            self._searches[key] = search
            return self._with_prediction(search.candidates[0], "warmup", key, shape, backward), timing
        index = search.next_trial()
        if index is None and self._next_r(search):
            index = search.next_trial()
        if index is not None:
            search.timings[index].append(timing)
            return self._with_prediction(search.candidates[index], "trial", key, shape, backward), timing
        best = self._finish_search(key, search)
        return self._with_prediction(best, "dictionary", key, shape, backward), timing

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the planner has decided and measured so far, as JSON: the dictionary of best plans
        and the searches in progress (candidates, trials issued, finished trial times), so a resumed
        run makes the choices the interrupted one would have made."""
        return {
            "dictionary": {str(key): asdict(plan) for key, plan in self.dictionary.items()},
            "searches": {str(key): _search_state(search) for key, search in self._searches.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the cost-model cache rebuilds itself)."""
        self.dictionary = {int(key): Plan(**plan) for key, plan in state.get("dictionary", {}).items()}
        self._searches = {int(key): _restored_search(search) for key, search in state.get("searches", {}).items()}

    # -- internals ------------------------------------------------------------------------------

    def _candidates(self, shape: RegionShape, backward: bool, degrees: tuple[int, ...] | None) -> list[Plan]:
        """Search: {1, 2, 4, 8} x algorithms. Auto: the model's top few of every degree up to 16, then
        {1, 2, 4, 8} with the model's best algorithm as anchors: when the model is wrong (on the 2x1
        emulated cluster it put d=16 first for compute-bound layers, 2-3x slower than d=2), the
        online check still has a good plan to find."""
        model = self.model
        if self.cost_model is not None:
            every = degrees or range(1, MAX_MODEL_DEGREE + 1)
            ranked = self._simulated(shape, every, backward) or self._ranked(shape, every, backward)
            top = [plan for plan, _ in ranked[: self.top_candidates]]
            sending = [plan.algorithm for plan, _ in ranked if plan.algorithm != LOCAL]
            best_algorithm = sending[:1] or (top[0].algorithm,)
            anchors = model.candidates(shape, degrees or SEARCH_DEGREES, best_algorithm, self.cost_model)
            return list(dict.fromkeys(top + anchors))
        return model.candidates(shape, degrees or SEARCH_DEGREES, self.algorithms)

    def _new_search(self, candidates: list[Plan]) -> _Search:
        """Trials of every candidate; with more than two Tutel r between 1 and S - 1, only r = 0,
        r = S and the ternary search's first r at first (Tutel §3.3), the others held back."""
        rs = sorted({plan.r for plan in candidates if plan.r is not None})
        interior = tuple(rs[1:-1]) if rs and rs[0] == 0 else tuple(rs[:-1])
        if len(interior) <= 2:
            return _Search(candidates, self.search_trials)
        first = {r for r in rs if r not in interior} | {ternary_next_r(interior, {})}
        search = _Search([p for p in candidates if p.r in first], self.search_trials)
        search.held_back, search.interior_rs = [p for p in candidates if p.r not in first], interior
        return search

    def _next_r(self, search: _Search) -> bool:
        """Add the plans of the ternary search's next r (all ranks agree: slowest-rank medians)."""
        if not search.held_back:
            return False
        values = self._slowest_medians(search)
        best_of_r: dict[int, float] = {}
        for plan, seconds in zip(search.candidates, values, strict=True):
            if plan.r in search.interior_rs:
                best_of_r[plan.r] = min(seconds, best_of_r.get(plan.r, seconds))
        r = ternary_next_r(search.interior_rs, best_of_r)
        if r is None:
            return False
        search.add([p for p in search.held_back if p.r == r])
        search.held_back = [p for p in search.held_back if p.r != r]
        return True

    def _simulated(self, shape: RegionShape, degrees: Sequence[int] | range, backward: bool) -> list | None:
        """The candidates ranked by the simulator on the profile's twin (None: not simulated)."""
        if self._simulator is None:
            return None
        return self._simulator.rank(shape, self.model.candidates(shape, degrees, self.algorithms, self.cost_model),
                                    backward)

    def _ranked(self, shape: RegionShape, degrees: Sequence[int] | range, backward: bool) -> list:
        assert self.cost_model is not None
        return rank_schedule_plans(self.cost_model, shape, (self.model,), degrees, self.algorithms, backward)

    def _model_choice(self, shape: RegionShape, backward: bool) -> Plan:
        cache_key = (shape, backward)
        if cache_key not in self._model_cache:
            self._model_cache[cache_key] = self._ranked(shape, range(1, MAX_MODEL_DEGREE + 1), backward)[0][0]
        return self._model_cache[cache_key]

    def _slowest_medians(self, search: _Search) -> list[float]:
        """Each candidate's median trial time on the slowest rank (every rank gets the same list)."""
        medians = [statistics.median(t.total_s for t in timings) for timings in search.timings]
        return medians if self.reduce_max is None else self.reduce_max(medians)

    def _finish_search(self, key: int, search: _Search) -> Plan:
        values = self._slowest_medians(search)
        best = simplest_within(search.candidates, values, self.min_gain)
        self.dictionary[key] = best
        self.measured[key] = dict(zip(search.candidates, values, strict=True))
        del self._searches[key]
        return best

    def _with_prediction(
        self, plan: Plan, source: str, key: int | None, shape: RegionShape, backward: bool
    ) -> PlanChoice:
        modelled = plan.algorithm == LOCAL or plan.algorithm in _modelled_algorithms(self._predictor, (plan.algorithm,))
        if self._predictor is None or not modelled:
            return PlanChoice(plan, source, key)
        prediction = self.model.predict(plan, self._predictor, shape, backward)
        return PlanChoice(
            plan, source, key, prediction.forward_s, prediction.backward_s if backward else None,
            prediction.gradient_sync_s if backward else None,
        )


def _search_state(search: _Search) -> dict[str, Any]:
    return {"candidates": [asdict(p) for p in search.candidates], "trials": search.trials, "issued": search.issued,
            "seconds": [[t.total_s for t in timings] for timings in search.timings],
            "held_back": [asdict(p) for p in search.held_back], "interior_rs": list(search.interior_rs)}


def _restored_search(state: dict[str, Any]) -> _Search:
    """A search as saved; a finished trial's time comes back as its total (all the search reads)."""
    search = _Search([Plan(**p) for p in state["candidates"]], int(state["trials"]))
    search.timings = [[PipelineTiming(forward_s=float(t)) for t in times] for times in state["seconds"]]
    search.issued = int(state["issued"])
    search.held_back = [Plan(**p) for p in state.get("held_back", [])]
    search.interior_rs = tuple(int(r) for r in state.get("interior_rs", []))
    return search


def ternary_next_r(interior: Sequence[int], measured: dict[int, float]) -> int | None:
    """Tutel §3.3: the next r of a ternary search over the sorted ``interior`` r (1 .. S - 1, where
    the cost is convex in r), given the best time ``measured`` for each r tried so far; None when
    the search is over. Replays the search from the start, so it is a pure function."""
    lo, hi = 0, len(interior) - 1
    while hi - lo > 2:
        third = (hi - lo) // 3
        left, right = interior[lo + third], interior[hi - third]
        for r in (left, right):
            if r not in measured:
                return r
        if measured[left] < measured[right]:
            hi = hi - third - 1
        else:
            lo = lo + third + 1
    return next((r for r in interior[lo:hi + 1] if r not in measured), None)


def simplest_within(candidates: Sequence[Plan], seconds: Sequence[float], min_gain: float) -> Plan:
    """The plan with the fewest chunks among those within ``min_gain`` of the fastest (then the
    faster, then the earlier candidate)."""
    fastest = min(seconds)
    near = [i for i, s in enumerate(seconds) if s <= fastest * (1 + min_gain)]
    return candidates[min(near, key=lambda i: (candidates[i].degree, seconds[i], i))]


def _modelled_algorithms(cost_model: CostModel | None, algorithms: tuple[str, ...]) -> tuple[str, ...]:
    """The algorithms the profile can predict (none without the GEMM fit)."""
    if cost_model is None or "gemm" not in cost_model.profile.fits:
        return ()
    local = ReplicatedModel().can_predict(cost_model)
    return tuple(a for a in algorithms if (a == LOCAL and local) or f"alltoall.{a}" in cost_model.profile.fits)
