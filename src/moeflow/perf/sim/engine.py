"""The discrete-event core: a DAG of compute and transfer operations on per-rank streams.

Compute runs on every rank at once (SPMD) with per-rank durations, so a skewed expert load delays
only its rank; a transfer is a collective that starts when every rank has reached it and then
competes for the network with the transfers in flight (fluid max-min sharing: two transfers on one
link each get half of it). Operations on one stream run in issue order, as on a CUDA or NCCL
stream. Events are transfer starts and ends; compute is resolved as soon as its inputs are.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from moeflow.perf.sim.network import Transfer

Times = float | np.ndarray  # one time for every rank, or one per rank
EPSILON = 1e-12  # transfers ending within a picosecond of each other end together
# The streams of a step: GEMMs and copies; expert all-to-alls (and their weight gathers); gradient
# all-reduces; model-parallel (tensor-parallel) collectives, which Parm's SAA runs beside the all-to-all.
COMPUTE, ALLTOALL, GRADIENTS, MODEL_PARALLEL = "compute", "alltoall", "gradients", "model-parallel"


@dataclass
class _Op:
    stream: str
    deps: list[int]
    category: str
    seconds: Times = 0.0
    transfer: Transfer | None = None
    priority: int = 0


@dataclass
class Timeline:
    """The operations of one step, their finish times once :meth:`run` has run, and the busy time
    per category (compute: mean over ranks; transfers: start to end)."""

    world: int
    ops: list[_Op] = field(default_factory=list)
    finish: list[Times] = field(default_factory=list)
    start: list[Times] = field(default_factory=list)
    _last_on_stream: dict[str, int] = field(default_factory=dict)

    def compute(self, stream: str, seconds: Times, deps: list[int] | tuple[int, ...] = (),
                category: str = "compute") -> int:
        """Work on every rank (``seconds`` per rank, or one value for all); returns its id."""
        return self._add(_Op(stream, list(deps), category, seconds=seconds))

    def transfer(self, stream: str, transfer: Transfer, deps: list[int] | tuple[int, ...] = (),
                 category: str = "communication", priority: int = 0) -> int:
        """A collective step; a higher ``priority`` is served first where transfers share a link
        (Lina's all-to-all over the gradient all-reduce)."""
        return self._add(_Op(stream, list(deps), category, transfer=transfer, priority=priority))

    def _add(self, op: _Op) -> int:
        index = len(self.ops)
        previous = self._last_on_stream.get(op.stream)
        if previous is not None:
            op.deps.append(previous)
        self._last_on_stream[op.stream] = index
        self.ops.append(op)
        return index

    def run(self) -> Timeline:
        _Simulation(self).run()
        return self

    # -- results ----------------------------------------------------------------------------------

    def makespan(self) -> float:
        """Seconds from the first operation to the last rank's end."""
        return max((float(np.max(f)) for f in self.finish), default=0.0)

    def busy(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for op, begin, end in zip(self.ops, self.start, self.finish, strict=True):
            totals[op.category] += float(np.mean(np.asarray(end) - np.asarray(begin)))
        return dict(totals)


class _Simulation:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        ops = timeline.ops
        self.waiting = [len(set(op.deps)) for op in ops]
        self.dependents: list[list[int]] = [[] for _ in ops]
        for index, op in enumerate(ops):
            for dep in set(op.deps):
                self.dependents[dep].append(index)
        timeline.finish = [0.0] * len(ops)
        timeline.start = [0.0] * len(ops)
        self.pending: list[tuple[float, int]] = []  # (time its bandwidth phase begins, op)
        self.active: dict[int, float] = {}  # op -> fraction of its work left
        self.rates: dict[int, float] | None = None
        self.now = 0.0

    def run(self) -> None:
        for index in [i for i, count in enumerate(self.waiting) if count == 0]:  # roots, before any release
            self._ready(index)
        while self.pending or self.active:
            self._advance()
        if any(count > 0 for count in self.waiting):
            raise RuntimeError("the step's operations form a cycle: some never became ready")

    def _ready(self, index: int) -> None:
        stack = [index]
        while stack:
            current = stack.pop()
            op = self.timeline.ops[current]
            begin: Times = 0.0
            for dep in op.deps:
                begin = np.maximum(begin, self.timeline.finish[dep])
            if op.transfer is None:
                self.timeline.start[current] = begin
                self.timeline.finish[current] = begin + op.seconds
                stack.extend(self._release(current))
                continue
            begin = float(np.max(begin))
            self.timeline.start[current] = begin
            heapq.heappush(self.pending, (begin + op.transfer.latency_s, current))

    def _release(self, index: int) -> list[int]:
        ready = []
        for dependent in self.dependents[index]:
            self.waiting[dependent] -= 1
            if self.waiting[dependent] == 0:
                ready.append(dependent)
        return ready

    def _advance(self) -> None:
        next_start = self.pending[0][0] if self.pending else np.inf
        rates = self._rates()
        remaining = {i: left / rates[i] for i, left in self.active.items()}
        first = min(remaining, key=remaining.__getitem__, default=None)
        done_in = np.inf if first is None else remaining[first]
        if next_start <= self.now + done_in:
            self._progress(next_start - self.now, rates)
            while self.pending and self.pending[0][0] <= self.now:
                _, index = heapq.heappop(self.pending)
                if float(self.timeline.ops[index].transfer.work.max(initial=0.0)) <= 0:
                    self._complete(index)
                else:
                    self.active[index] = 1.0
                    self.rates = None
            return
        self._progress(done_in, rates)
        for index in [i for i, seconds in remaining.items() if i == first or seconds - done_in <= EPSILON]:
            del self.active[index]
            self.rates = None
            self._complete(index)

    def _progress(self, seconds: float, rates: dict[int, float]) -> None:
        self.now += seconds
        for index in self.active:
            self.active[index] -= rates[index] * seconds

    def _complete(self, index: int) -> None:
        self.timeline.finish[index] = self.now
        for ready in self._release(index):
            self._ready(ready)

    def _rates(self) -> dict[int, float]:
        """Fraction of its work each active transfer completes per second."""
        if self.rates is None:
            indices = list(self.active)
            ops = self.timeline.ops
            works = [ops[i].transfer.work for i in indices]
            self.rates = dict(zip(indices, fair_rates(works, [ops[i].priority for i in indices]), strict=True))
        return self.rates


def fair_rates(works: list[np.ndarray], priorities: list[int]) -> list[float]:
    """Max-min fair progress rates by progressive filling: on every resource the transfers using it
    share it equally, a transfer bottlenecked elsewhere leaves its unused share to the others, and a
    higher priority class is filled before a lower one gets what is left."""
    if len(works) <= 1:
        return [1.0 / float(w.max()) for w in works]
    demand = np.stack(works)
    capacity = np.ones(demand.shape[1])
    rates = [0.0] * len(works)
    for level in sorted(set(priorities), reverse=True):
        open_ = [i for i, p in enumerate(priorities) if p == level]
        while open_:
            using = demand[open_] > 0
            sharing = np.maximum(using.sum(axis=0), 1)
            share = np.maximum(capacity, 0.0) / sharing
            with np.errstate(divide="ignore"):
                limits = np.where(using, share / np.where(using, demand[open_], 1.0), np.inf).min(axis=1)
            chosen = int(np.argmin(limits))
            index = open_.pop(chosen)
            rates[index] = max(float(limits[chosen]), 1e-12)
            capacity -= rates[index] * demand[index]
    return rates
