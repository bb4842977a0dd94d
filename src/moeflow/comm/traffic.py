"""Who is on the links: the MoE all-to-alls announce themselves here, so that Lina's gradient
scheduler can hold its all-reduce micro-ops while an all-to-all is imminent, queued or running
(Lina §4.2), and so that a step's communication can be drawn as a timeline (Lina Fig. 7/8).

One :class:`AllToAllTraffic` belongs to a job's :class:`~moeflow.comm.ParallelGroups`: every MoE
layer of the job and the trainer's gradient synchronization see the same one. The scheduling is
local to the process (Lina §6.1): no rank asks another.

On CUDA tensors an all-to-all's time is read from CUDA events around it (:mod:`moeflow.comm.clock`)
once it has run, and its timeline event is placed on the host clock through the device's anchor;
on CPU tensors both are the host clock.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx

from moeflow.comm.clock import DeviceClock, Span
from moeflow.comm.ledger import CollectiveLedger

EVENT_KINDS = ("alltoall", "allreduce", "experts", "forward", "backward")
"""What a timeline event is: an all-to-all, an all-reduce (micro-op or bucket), an expert chunk's
compute, or a step's forward and backward spans."""

_UNREAD_SPANS = 256
"""All-to-all spans kept unread before those that have run are added up (bounds their events)."""


@dataclass(frozen=True)
class TimelineEvent:
    kind: str
    start_s: float  # time.perf_counter() (a device span: placed on it through the device's anchor)
    stop_s: float

    @property
    def seconds(self) -> float:
        return self.stop_s - self.start_s


class Timeline:
    """Events recorded from any thread while ``enabled``; :meth:`take` hands them over and clears
    (a device span's times are read there, once its work has run)."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[TimelineEvent | tuple[str, Span]] = []
        self._lock = threading.Lock()

    def record(self, kind: str, start_s: float, stop_s: float) -> None:
        if self.enabled:
            with self._lock:
                self._events.append(TimelineEvent(kind, start_s, stop_s))

    def record_span(self, kind: str, span: Span) -> None:
        """A span of :class:`~moeflow.comm.clock.DeviceClock` (host or device), read at :meth:`take`."""
        if self.enabled:
            with self._lock:
                self._events.append((kind, span))

    def take(self) -> list[TimelineEvent]:
        with self._lock:
            events, self._events = self._events, []
        return [event if isinstance(event, TimelineEvent) else TimelineEvent(event[0], *event[1].interval())
                for event in events]


class AllToAllTraffic:
    """The all-to-alls that are imminent, queued on a communication worker or running.

    - :meth:`expect`: a combine's backward begins, so its layer's all-to-alls are imminent (Lina
      stops launching all-reduce micro-ops here) until the layer's backward ends (:meth:`settle`).
      Lina lets a micro-op start in the expert compute between a layer's two all-to-alls; with the
      capacity-chunk pipeline those gaps are shorter than a micro-op, which would then slow the
      next chunk's all-to-all, so the whole of a layer's backward counts as imminent here;
    - :meth:`enqueue` / :meth:`running`: an all-to-all waits on the worker / moves bytes;
    - :meth:`imminent` and :meth:`on_settle`: what Lina's gradient scheduler reads and is called
      at (points of the backward's graph, the same on every rank).

    :attr:`alltoall_seconds` and :attr:`alltoall_ops` count every all-to-all since the job began
    (Lina's packing reads them): host time on CPU tensors, device time (CUDA events) on CUDA ones.
    """

    def __init__(self) -> None:
        self.timeline = Timeline()
        self.clock = DeviceClock()  # one host clock for this job's spans, device ones included
        self._lock = threading.Lock()
        self._busy = 0
        self._imminent = False
        self._settled: list[weakref.WeakMethod] = []
        self._alltoall_seconds = 0.0
        self._unread: list[Span] = []  # spans of finished all-to-alls whose device time is not read yet
        self.alltoall_ops = 0

    @property
    def alltoall_seconds(self) -> float:
        """Every all-to-all's seconds since the job began; on CUDA this waits for the last ones'
        end events (not for the device)."""
        with self._lock:
            unread, self._unread = self._unread, []
        seconds = sum(span.seconds() for span in unread)
        with self._lock:
            self._alltoall_seconds += seconds
            return self._alltoall_seconds

    @property
    def clear(self) -> bool:
        with self._lock:
            return self._busy == 0 and not self._imminent

    @property
    def imminent(self) -> bool:
        """Whether a layer's all-to-alls are imminent: between :meth:`expect` and :meth:`settle`,
        points of the backward's graph (the same on every rank, unlike what is queued or running)."""
        with self._lock:
            return self._imminent

    def on_settle(self, callback: Callable[[], None]) -> None:
        """Call the bound method ``callback`` on the settling thread each time a layer's backward
        ends (Lina's scheduler issues the micro-ops it held there), for as long as its object lives
        (a scheduler replaced by another is not kept alive by this)."""
        self._settled.append(weakref.WeakMethod(callback))  # type: ignore[arg-type]

    def expect(self) -> None:
        with self._lock:
            self._imminent = True

    def settle(self) -> None:
        with self._lock:
            self._imminent = False
        self._settled = [method for method in self._settled if method() is not None]
        for method in self._settled:
            if (callback := method()) is not None:
                callback()

    def enqueue(self) -> None:
        """An all-to-all waits on a communication worker (until :meth:`dequeue`)."""
        self._enter()

    def dequeue(self) -> None:
        self._leave()

    @contextmanager
    def running(self, device: torch.device | None = None) -> Iterator[None]:
        """An all-to-all moves bytes in this block, on tensors of ``device`` (None: the host clock).
        On CUDA its time is that of events recorded on the current stream around the block."""
        self._enter()
        span = self.clock.start(device)
        try:
            yield
        finally:
            span.stop()
            self.timeline.record_span("alltoall", span)
            self._leave(span)

    def _enter(self) -> None:
        with self._lock:
            self._busy += 1

    def _leave(self, alltoall: Span | None = None) -> None:
        with self._lock:
            self._busy -= 1
            if alltoall is not None:
                self._unread.append(alltoall)
                self.alltoall_ops += 1
                if len(self._unread) > _UNREAD_SPANS:  # nobody reads the total: fold what has run
                    finished = [span.done() for span in self._unread]
                    self._alltoall_seconds += sum(s.seconds() for s, f in zip(self._unread, finished, strict=True) if f)
                    self._unread = [s for s, f in zip(self._unread, finished, strict=True) if not f]


def mark_backward_window(
    x: torch.Tensor, traffic: AllToAllTraffic, entering: bool, ledger: CollectiveLedger | None = None,
    layer: int | None = None,
) -> torch.Tensor:
    """Identity in the forward. In the backward, at a layer's output (``entering=False``) it tells
    ``traffic`` that the layer's all-to-alls are imminent and ``ledger`` that the backward of
    ``layer`` runs; at its input (``entering=True``), that the layer's backward is over."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return _BackwardWindow.apply(x, traffic, entering, ledger, layer)


class _BackwardWindow(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, traffic: AllToAllTraffic, entering: bool,
        ledger: CollectiveLedger | None, layer: int | None,
    ) -> torch.Tensor:
        ctx.traffic, ctx.entering, ctx.ledger, ctx.layer = traffic, entering, ledger, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        (ctx.traffic.settle if ctx.entering else ctx.traffic.expect)()
        if ctx.ledger is not None:
            where = ctx.ledger.location
            where.layer, where.direction = (None, None) if ctx.entering else (ctx.layer, "backward")
        return grad, None, None, None, None


def contention_seconds(events: list[TimelineEvent]) -> dict[str, float]:
    """A step's all-to-all seconds, split by whether an all-reduce ran at the same time (Lina's
    contention, §2.2), with the counts of each and the all-reduces' own seconds."""
    reduces = sorted((e.start_s, e.stop_s) for e in events if e.kind == "allreduce")
    alone = contended = 0.0
    alone_ops = contended_ops = 0
    for event in (e for e in events if e.kind == "alltoall"):
        if any(start < event.stop_s and event.start_s < stop for start, stop in reduces):
            contended, contended_ops = contended + event.seconds, contended_ops + 1
        else:
            alone, alone_ops = alone + event.seconds, alone_ops + 1
    return {
        "all_to_all_alone": alone, "all_to_all_with_allreduce": contended,
        "all_to_all_alone_ops": alone_ops, "all_to_all_with_allreduce_ops": contended_ops,
        "allreduce": sum(stop - start for start, stop in reduces), "allreduce_ops": len(reduces),
    }
