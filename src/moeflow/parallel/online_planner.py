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

  Where moeflow departs from Tutel, so that a run settles (:class:`TrialBudget`): the trials run in
  rounds, one call of each candidate still in; after a round, a candidate whose median is over
  ``prune_margin`` slower than the fastest stops; a search ends after ``calls`` timed calls or
  ``seconds`` of trials, or when one candidate is left. A new key whose capacity lies within
  ``replan_margin`` of a settled one's takes its plan (and joins a search in progress the same
  way), so a dropless layer's capacity moving a little from step to step does not start a search.
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

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from moeflow.config import validate_pipeline
from moeflow.core.stats import PipelineTiming
from moeflow.perf import ClusterProfile, CostModel
from moeflow.perf.kernel_rates import KernelRates
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

SETTLED = "settled"
"""The source of a plan the planner serves after its search (Tutel's dictionary)."""
DECIDED = (SETTLED, "forced", "local")
"""The sources of a plan the planner no longer searches for (settled, or nothing to search)."""
UNTIMED = "untimed"
"""The source of a plan served outside training mode while its key is still searched."""
SEARCH_DEGREES = (1, 2, 4, 8)
"""The pipeline degrees the online search times."""
MAX_MODEL_DEGREE = 16
"""The largest pipeline degree the cost model ranks."""
ReduceMax = Callable[[Sequence[float]], list[float]]


@dataclass(frozen=True)
class TrialBudget:
    """How much a search may spend before it settles: ``calls`` timed calls and ``seconds`` of the
    slowest rank's trial time; ``per_candidate`` calls of one candidate at most; a candidate whose
    median is more than ``prune_margin`` over the fastest's stops after its round; a capacity
    within ``replan_margin`` of a settled one takes its plan. With one warm-up call and the default
    8 calls, a layer settles by its 10th forward."""

    calls: int = 8
    seconds: float = 30.0
    per_candidate: int = 3
    prune_margin: float = 0.3
    replan_margin: float = 0.25

    def __post_init__(self) -> None:
        if self.calls < 1 or self.per_candidate < 1 or self.seconds <= 0:
            raise ValueError(f"a trial budget needs calls >= 1, per_candidate >= 1 and seconds > 0; got {self}")

    def near(self, capacity: int, settled: int) -> bool:
        """Whether ``capacity`` is close enough to ``settled`` to run the same plan."""
        return abs(capacity - settled) <= self.replan_margin * settled


@dataclass(frozen=True)
class PlanChoice:
    """The plan of one forward and why: ``source`` is forced, model, warmup, trial, settled or local;
    ``trial_cost_s`` is what the search that settled it spent over running its plan throughout."""

    plan: Plan
    source: str
    key: int | None = None
    predicted_forward_s: float | None = None
    predicted_backward_s: float | None = None
    predicted_gradient_sync_s: float | None = None
    trial_cost_s: float | None = None


@dataclass
class _Search:
    """One key's trials in rounds: ``alive`` the candidates still in, ``queue`` the rest of this
    round's calls, ``capacity`` the capacity the search started at. The ternary search over Tutel's
    r (O(log S) steps) adds a call to the budget for each plan it adds."""

    candidates: list[Plan]
    budget: TrialBudget
    capacity: int = 0
    timings: list[list[PipelineTiming]] = field(default_factory=list)
    issued: int = 0
    alive: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    held_back: list[Plan] = field(default_factory=list)  # plans of Tutel r's the ternary search may add
    interior_rs: tuple[int, ...] = ()
    added: int = 0  # plans the ternary search over Tutel's r added: each adds a call to the budget

    def __post_init__(self) -> None:
        self.timings = [[] for _ in self.candidates]
        self.alive = list(range(len(self.candidates)))
        self.queue = self.alive[: self.budget.calls]

    def add(self, plans: list[Plan]) -> None:
        first = len(self.candidates)
        self.candidates.extend(plans)
        self.timings.extend([] for _ in plans)
        self.alive.extend(range(first, len(self.candidates)))
        self.added += len(plans)

    def next_trial(self) -> int | None:
        """The candidate of the next call of this round (None: the round is over)."""
        if not self.queue:
            return None
        self.issued += 1
        return self.queue.pop(0)

    def next_round(self, seconds: Sequence[float]) -> None:
        """Drop the candidates ``prune_margin`` behind the fastest (``seconds``: slowest-rank medians,
        inf where untimed) and queue the next round within the budget (none: the search is over)."""
        budget = self.budget
        timed = [seconds[i] for i in self.alive if self.timings[i]]
        fastest = min(timed, default=math.inf)
        self.alive = [i for i in self.alive if not self.timings[i] or seconds[i] <= fastest * (1 + budget.prune_margin)]
        spent = sum(s * len(t) for s, t in zip(seconds, self.timings, strict=True) if t)
        first_added = len(self.candidates) - self.added  # the ternary search's r's go first
        untimed = sorted((i for i in self.alive if not self.timings[i]), key=lambda i: (i < first_added, i))
        if spent >= budget.seconds or (len(self.alive) == 1 and not untimed):
            return
        again = sorted((i for i in self.alive if 0 < len(self.timings[i]) < budget.per_candidate),
                       key=lambda i: seconds[i])
        self.queue = (untimed + again)[: max(0, budget.calls + self.added - self.issued)]

    def cost(self, seconds: Sequence[float], best: int) -> float:
        """The trials' time over what the chosen plan would have taken in their calls (slowest rank)."""
        return sum((s - seconds[best]) * len(t) for s, t in zip(seconds, self.timings, strict=True) if t)


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
        budget: TrialBudget | None = None,
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
        self.budget = budget or TrialBudget()
        self.top_candidates = top_candidates
        self.min_gain = min_gain
        # under "auto", the simulator's ranking on the profile's twin (``ranker`` builds it) orders the trials
        self._simulator = None
        if ranker is not None and degree_policy == "auto" and self.cost_model is not None:
            self._simulator = ranker(self.cost_model.profile)
        self.dictionary: dict[int, Plan] = {}
        self.settled_at: dict[int, int] = {}  # key -> the capacity its search ran at
        self.trial_cost: dict[int, float] = {}  # key -> what its search spent over its plan (slowest rank)
        self.measured: dict[int, dict[Plan, float]] = {}  # key -> slowest-rank median per candidate
        self._searches: dict[int, _Search] = {}
        self.kernel_rates: KernelRates | None = None  # expert_kernel="auto": probed once, agreed by all ranks
        self._model_cache: dict[tuple[RegionShape, bool], Plan] = {}

    def choose(
        self, shape: RegionShape, backward: bool, r: int | None = None, timed: bool = True
    ) -> tuple[PlanChoice, PipelineTiming]:
        """The plan for this forward, and the timing record its execution must fill; ``r`` forces
        Tutel's r for this call (the degree is then the forced one, or 1, on the first algorithm).
        ``timed=False`` (a call outside training mode, alike on every rank): a settled plan or the
        first candidate, with no trial spent on a forward that has no backward to time."""
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

        key = self._key(shape.capacity)
        if key in self.dictionary:
            return self._settled(key, shape, backward), timing
        search = self._searches.get(key)
        if not timed:
            plan = search.candidates[0] if search is not None else self._candidates(shape, backward, degrees)[0]
            return self._with_prediction(plan, UNTIMED, key, shape, backward), timing
        if search is None:  # the first call at a new key pays one-time costs: run it untimed
            search = self._new_search(self._candidates(shape, backward, degrees), shape.capacity)
            self._searches[key] = search
            return self._with_prediction(search.candidates[0], "warmup", key, shape, backward), timing
        index = search.next_trial()
        if index is None:  # the round is over: one all-reduce of its medians serves both what follows
            values = self._next_round(search)
            index = search.next_trial()
            if index is None:
                self._finish_search(key, search, values)
                return self._settled(key, shape, backward), timing
        search.timings[index].append(timing)
        return self._with_prediction(search.candidates[index], "trial", key, shape, backward), timing

    def _key(self, capacity: int) -> int:
        """Tutel's key of ``capacity``, or the key of a settled plan or a search in progress whose
        capacity it is near (the replan margin): the load moving a little keeps the plan."""
        key = capacity // self.capacity_bucket
        if key in self.dictionary or key in self._searches:
            return key
        near = [k for k, at in self.settled_at.items() if self.budget.near(capacity, at)]
        near += [k for k, search in self._searches.items() if self.budget.near(capacity, search.capacity)]
        return min(near, key=lambda k: (abs(self._capacity_of(k) - capacity), k), default=key)

    def _capacity_of(self, key: int) -> int:
        search = self._searches.get(key)
        return search.capacity if search is not None else self.settled_at[key]

    def _settled(self, key: int, shape: RegionShape, backward: bool) -> PlanChoice:
        choice = self._with_prediction(self.dictionary[key], SETTLED, key, shape, backward)
        return dataclasses.replace(choice, trial_cost_s=self.trial_cost.get(key))

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the planner has decided and measured so far, as JSON: the dictionary of best plans,
        the searches in progress (candidates, trials issued, finished trial times) and the probed
        expert-kernel rates, so a resumed run makes the choices the interrupted one would have made."""
        return {
            "dictionary": {str(key): asdict(plan) for key, plan in self.dictionary.items()},
            "settled_at": {str(key): capacity for key, capacity in self.settled_at.items()},
            "trial_cost": {str(key): seconds for key, seconds in self.trial_cost.items()},
            "searches": {str(key): _search_state(search) for key, search in self._searches.items()},
            "kernel_rates": None if self.kernel_rates is None else self.kernel_rates.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the cost-model cache rebuilds itself). A state saved
        before the replan margin existed settles each key at its bucket's first capacity."""
        self.dictionary = {int(key): Plan(**plan) for key, plan in state.get("dictionary", {}).items()}
        saved_at = {int(key): int(capacity) for key, capacity in state.get("settled_at", {}).items()}
        self.settled_at = {key: saved_at.get(key, key * self.capacity_bucket) for key in self.dictionary}
        self.trial_cost = {int(key): float(seconds) for key, seconds in state.get("trial_cost", {}).items()}
        self._searches = {int(key): _restored_search(search, self.budget)
                          for key, search in state.get("searches", {}).items()}
        rates = state.get("kernel_rates")
        self.kernel_rates = None if rates is None else KernelRates.from_state(rates)

    # -- internals ------------------------------------------------------------------------------

    def _candidates(self, shape: RegionShape, backward: bool, degrees: tuple[int, ...] | None) -> list[Plan]:
        """Search: {1, 2, 4, 8} x algorithms, by degree. Auto: the model's top few of every degree up to 16, then
        {1, 2, 4, 8} with the model's best algorithm and exchange as anchors: when the model is wrong (on the 2x1
        emulated cluster it put d=16 first for compute-bound layers, 2-3x slower than d=2), the
        online check still has a good plan to find."""
        model = self.model
        if self.cost_model is not None:
            every = degrees or range(1, MAX_MODEL_DEGREE + 1)
            ranked = self._simulated(shape, every, backward) or self._ranked(shape, every, backward)
            top = [plan for plan, _ in ranked[: self.top_candidates]]
            best = next((plan for plan, _ in ranked if plan.algorithm != LOCAL), top[0])
            plain = model.forced_plan(1, best.algorithm)  # the schedule's own exchange, where the best is another's
            exchange = best.exchange if best.schedule == model.name or plain is None else plain.exchange
            anchors = [plan for plan in model.candidates(shape, degrees or SEARCH_DEGREES, (best.algorithm,),
                                                         self.cost_model)
                       if plan.schedule != model.name or plan.exchange == exchange]
            return list(dict.fromkeys(top + anchors))
        # the schedule's own plans by fewest chunks, every algorithm at each, then the others (FasterMoE's
        # smart schedule): what the budget's first round leaves out is the deepest pipelines, not an algorithm
        plans = model.candidates(shape, degrees or SEARCH_DEGREES, self.algorithms)
        return sorted(plans, key=lambda plan: (plan.schedule != plans[0].schedule, plan.degree))

    def _new_search(self, candidates: list[Plan], capacity: int) -> _Search:
        """Trials of every candidate; with more than two Tutel r between 1 and S - 1, only r = 0,
        r = S and the ternary search's first r at first (Tutel §3.3), the others held back."""
        rs = sorted({plan.r for plan in candidates if plan.r is not None})
        interior = tuple(rs[1:-1]) if rs and rs[0] == 0 else tuple(rs[:-1])
        if len(interior) <= 2:
            return _Search(candidates, self.budget, capacity)
        first = {r for r in rs if r not in interior} | {ternary_next_r(interior, {})}
        search = _Search([p for p in candidates if p.r in first], self.budget, capacity)
        search.held_back, search.interior_rs = [p for p in candidates if p.r not in first], interior
        return search

    def _next_round(self, search: _Search) -> list[float]:
        """After a round: the ternary search's next r joins, the slow candidates stop, the next
        round is queued, if any (all ranks agree: one all-reduce of the slowest-rank medians,
        returned, inf for the plans just added)."""
        values = self._slowest_medians(search)
        if self._next_r(search, values):
            values = [*values, *[math.inf] * (len(search.candidates) - len(values))]
        search.next_round(values)
        return values

    def _next_r(self, search: _Search, values: Sequence[float]) -> bool:
        """Add the plans of the ternary search's next r."""
        if not search.held_back:
            return False
        best_of_r: dict[int, float] = {}
        for plan, seconds in zip(search.candidates, values, strict=True):
            if plan.r in search.interior_rs and math.isfinite(seconds):
                best_of_r[plan.r] = min(seconds, best_of_r.get(plan.r, seconds))
        r = ternary_next_r(search.interior_rs, best_of_r)
        added = [p for p in search.held_back if p.r == r]
        if r is None or not added:
            return False
        search.add(added)
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
        """Each candidate's median trial time on the slowest rank, inf where untimed (every rank gets
        the same list)."""
        medians = [statistics.median(t.total_s for t in timings) if timings else math.inf
                   for timings in search.timings]
        return medians if self.reduce_max is None else self.reduce_max(medians)

    def _finish_search(self, key: int, search: _Search, values: Sequence[float]) -> None:
        """Settle ``key`` on the simplest of the timed candidates within ``min_gain`` of the fastest
        (``values``: the last round's slowest-rank medians)."""
        timed = [i for i, timings in enumerate(search.timings) if timings]
        choice = simplest_within([search.candidates[i] for i in timed], [values[i] for i in timed], self.min_gain)
        best = search.candidates.index(choice)
        self.dictionary[key], self.settled_at[key] = choice, search.capacity
        self.trial_cost[key] = search.cost(values, best)
        self.measured[key] = {search.candidates[i]: values[i] for i in timed}
        del self._searches[key]

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
    return {"candidates": [asdict(p) for p in search.candidates], "capacity": search.capacity,
            "issued": search.issued, "alive": search.alive, "queue": search.queue, "added": search.added,
            "seconds": [[t.total_s for t in timings] for timings in search.timings],
            "held_back": [asdict(p) for p in search.held_back], "interior_rs": list(search.interior_rs)}


def _restored_search(state: dict[str, Any], budget: TrialBudget) -> _Search:
    """A search as saved; a finished trial's time comes back as its total (all the search reads).
    A search saved before the rounds existed restarts its trials."""
    search = _Search([Plan(**p) for p in state["candidates"]], budget, int(state.get("capacity", 0)))
    search.held_back = [Plan(**p) for p in state.get("held_back", [])]
    search.interior_rs = tuple(int(r) for r in state.get("interior_rs", []))
    if "queue" not in state:
        return search
    search.timings = [[PipelineTiming(forward_s=float(t)) for t in times] for times in state["seconds"]]
    search.issued = int(state["issued"])
    search.alive, search.queue = [int(i) for i in state["alive"]], [int(i) for i in state["queue"]]
    search.added = int(state["added"])
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
