"""Data-parallel gradient synchronization of the replicated parameters, three ways (``--grad-sync``):

- ``after``: one flat all-reduce once the backward is over (no overlap);
- ``overlap``: DDP's way: the gradients, in buckets of whole tensors of about ``bucket_mb``, are
  all-reduced while the backward still runs, each bucket as soon as its last gradient is ready;
- ``lina``: Lina's communication scheduler (§4.2, §6.1): each gradient is cut into equal micro-ops
  of about ``microop_mb`` (never two large gradients in one; small ones fused), and a micro-op is launched only while no
  MoE all-to-all is imminent, queued or running (:class:`~moeflow.comm.traffic.AllToAllTraffic`:
  from a layer's combine backward to the end of its backward), so that the all-to-alls have the
  links to themselves.

The bucketed and micro-op all-reduces run on their own process group (so that they truly run
beside the MoE layers' all-to-alls) from one scheduler thread per process, in a fixed order that
is the same on every rank (reverse registration order, as DDP's first buckets), one at a time. On
CUDA the scheduler issues them on a communication stream of its own, each after an event recorded
when its gradients were ready, and the compute stream waits for that stream in ``finish()``: the
all-reduces overlap the backward's kernels instead of queueing behind them on one stream. Every
piece is reduced exactly once; the averages are the same numbers as ``after``'s (the same sums of
the same values; bitwise where the reduction order agrees, e.g. on 2 workers).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moeflow.comm.collectives import all_reduce
from moeflow.comm.ledger import CollectiveError, CollectiveLedger, tracked
from moeflow.comm.traffic import AllToAllTraffic
from moeflow.training.config import GRAD_SYNC_MODES

MEGABYTE = 1 << 20


@dataclass(frozen=True)
class GradientPiece:
    """What one all-reduce carries: elements [start, stop) of each listed parameter's flattened
    gradient (a micro-op: one parameter, part of it; a bucket: whole parameters)."""

    spans: tuple[tuple[int, int, int], ...]  # (parameter index, start, stop)

    @property
    def parameters(self) -> tuple[int, ...]:
        return tuple(index for index, _, _ in self.spans)

    @property
    def numel(self) -> int:
        return sum(stop - start for _, start, stop in self.spans)


def micro_ops(sizes: Sequence[int], element_bytes: int, microop_bytes: int) -> list[GradientPiece]:
    """Lina's tensor partitioning: a gradient of ``microop_bytes`` or more in equal consecutive
    parts of at most that, never sharing a micro-op with another gradient; runs of smaller whole
    gradients (norms, biases, gates) fused into micro-ops of at most that size, since a micro-op
    per small tensor would pay a collective's latency for a few bytes."""
    pieces: list[GradientPiece] = []
    per_op = max(1, microop_bytes // element_bytes)
    small: list[tuple[int, int, int]] = []
    for index, size in enumerate(sizes):
        if size < per_op:
            if sum(stop for _, _, stop in small) + size > per_op:
                pieces.append(GradientPiece(tuple(small)))
                small = []
            small.append((index, 0, size))
            continue
        if small:
            pieces.append(GradientPiece(tuple(small)))
            small = []
        parts = -(-size // per_op)
        bounds = [size * part // parts for part in range(parts + 1)]
        pieces.extend(GradientPiece(((index, bounds[p], bounds[p + 1]),)) for p in range(parts))
    if small:
        pieces.append(GradientPiece(tuple(small)))
    return pieces


def buckets(sizes: Sequence[int], element_bytes: int, bucket_bytes: int) -> list[GradientPiece]:
    """Whole gradients, in order, fused into buckets that close once they hold ``bucket_bytes``
    (DDP's bucketing: a bucket's size varies with the gradients' boundaries)."""
    pieces, current, filled = [], [], 0
    for index, size in enumerate(sizes):
        current.append((index, 0, size))
        filled += size * element_bytes
        if filled >= bucket_bytes:
            pieces.append(GradientPiece(tuple(current)))
            current, filled = [], 0
    if current:
        pieces.append(GradientPiece(tuple(current)))
    return pieces


class GradientScheduler:
    """All-reduces the pieces of the replicated gradients during the backward, in piece order,
    each once all its gradients are ready; with ``yield_to_alltoall``, only while ``traffic``
    has no all-to-all (Lina). :meth:`start` before the backward, :meth:`finish` after it."""

    def __init__(
        self, parameters: Sequence[nn.Parameter], pieces: Sequence[GradientPiece], group: dist.ProcessGroup,
        world_size: int, traffic: AllToAllTraffic, yield_to_alltoall: bool, ledger: CollectiveLedger | None = None,
    ) -> None:
        self.parameters, self.pieces = list(parameters), list(pieces)
        self.ledger = ledger
        self.group, self.world_size, self.traffic = group, world_size, traffic
        self.yield_to_alltoall = yield_to_alltoall
        self.launched: list[int] = []  # piece indices in launch order, this step (a test counts them)
        self._changed = threading.Condition()
        self._ready = [False] * len(self.parameters)
        self._draining = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ready_events: list[torch.cuda.Event | None] = [None] * len(self.parameters)
        self._stream: torch.cuda.Stream | None = None  # CUDA gradients: the all-reduces' stream
        for index, parameter in enumerate(self.parameters):
            parameter.register_post_accumulate_grad_hook(lambda _, index=index: self._mark_ready(index))

    def start(self) -> None:
        """Before the backward: every gradient pending, the scheduler thread waiting for them."""
        if self._thread is not None:
            raise RuntimeError("GradientScheduler.start() called twice without finish()")
        self.launched, self._ready = [], [False] * len(self.parameters)
        self._ready_events = [None] * len(self.parameters)
        self._draining, self._error = False, None
        self._thread = threading.Thread(target=self._run, name="moeflow-grad-sync", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """After the backward: gradients that got none count as zeros, every piece is reduced
        (the rest now, with nothing left to yield to), and each gradient becomes the average."""
        if self._thread is None:
            raise RuntimeError("GradientScheduler.finish() without start()")
        for parameter in self.parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        with self._changed:
            self._draining = True
            self._ready = [True] * len(self.parameters)
            self._changed.notify_all()
        self.traffic.wake()  # a micro-op held for an all-to-all goes now
        self._thread.join()
        self._thread = None
        if isinstance(self._error, CollectiveError):
            raise self._error  # its report names the all-reduce and every worker's place
        if self._error is not None:
            raise RuntimeError(f"a gradient all-reduce failed: {self._error}") from self._error
        if self._stream is not None:  # the averages below (and the optimizer) follow the all-reduces
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        for parameter in self.parameters:
            assert parameter.grad is not None
            parameter.grad.div_(self.world_size)

    def _mark_ready(self, index: int) -> None:
        grad = self.parameters[index].grad
        event = None
        if grad is not None and grad.is_cuda:  # on the stream the backward accumulated it on
            event = torch.cuda.current_stream(grad.device).record_event()
        with self._changed:
            self._ready_events[index] = event
            self._ready[index] = True
            self._changed.notify_all()

    def _run(self) -> None:
        try:
            for index, piece in enumerate(self.pieces):
                with self._changed:
                    self._changed.wait_for(lambda piece=piece: all(self._ready[i] for i in piece.parameters))
                self._hold_for_alltoall()
                self._all_reduce(piece)
                self.launched.append(index)
        except BaseException as error:  # re-raised by finish() on the training thread
            self._error = error

    def _hold_for_alltoall(self) -> None:
        """Lina's priority: wait while an all-to-all is imminent, queued or running (not once the
        backward is over: nothing is left to yield to)."""
        if self.yield_to_alltoall:
            self.traffic.wait_until_clear(unless=lambda: self._draining)

    def _all_reduce(self, piece: GradientPiece) -> None:
        grads = [self.parameters[index].grad for index in piece.parameters]
        assert all(grad is not None for grad in grads)
        if not grads[0].is_cuda:  # type: ignore[union-attr]
            return self._reduce(piece, grads)
        if self._stream is None:
            self._stream = torch.cuda.Stream(grads[0].device)  # type: ignore[union-attr]
        with torch.cuda.stream(self._stream):
            for index in piece.parameters:
                if (event := self._ready_events[index]) is not None:
                    self._stream.wait_event(event)
            return self._reduce(piece, grads)

    def _reduce(self, piece: GradientPiece, grads: list[torch.Tensor | None]) -> None:
        nbytes = sum(stop - start for _, start, stop in piece.spans) * grads[0].element_size()  # type: ignore[union-attr]
        with tracked(self.ledger, "gradient all-reduce", self.group, nbytes, phase="gradient sync"):
            self._reduce_now(piece, grads)

    def _reduce_now(self, piece: GradientPiece, grads: list[torch.Tensor | None]) -> None:
        # Lina's timeline: on CUDA, events on the stream the all-reduce is issued on (current here)
        span = self.traffic.clock.start(grads[0].device)  # type: ignore[union-attr]
        if len(piece.spans) == 1:  # a micro-op: in place on its part of the gradient
            (_, start, stop), grad = piece.spans[0], grads[0]
            all_reduce(grad.view(-1)[start:stop], self.group)
        else:  # a bucket: fused into one flat buffer and back
            flat = torch.cat([grad.reshape(-1) for grad in grads])  # type: ignore[union-attr]
            all_reduce(flat, self.group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))  # type: ignore[union-attr]
                offset += grad.numel()  # type: ignore[union-attr]
        span.stop()
        self.traffic.timeline.record_span("allreduce", span)


def gradient_scheduler(
    mode: str, parameters: Sequence[nn.Parameter], group: dist.ProcessGroup, world_size: int,
    traffic: AllToAllTraffic, microop_mb: float, bucket_mb: float, ledger: CollectiveLedger | None = None,
) -> GradientScheduler | None:
    """The scheduler of ``mode`` (None for ``after``, which reduces in one call after the backward)."""
    if mode not in GRAD_SYNC_MODES:
        raise ValueError(f"grad_sync={mode!r}; choose one of {', '.join(GRAD_SYNC_MODES)}")
    if mode == "after":
        return None
    sizes = [parameter.numel() for parameter in parameters]
    element_bytes = parameters[0].element_size() if parameters else 4
    if mode == "lina":
        pieces = micro_ops(sizes, element_bytes, int(microop_mb * MEGABYTE))
    else:
        pieces = buckets(sizes, element_bytes, int(bucket_mb * MEGABYTE))
    return GradientScheduler(parameters, pieces, group, world_size, traffic, yield_to_alltoall=mode == "lina",
                             ledger=ledger)
