"""Data-parallel gradient synchronization of the replicated parameters, three ways (``--grad-sync``):

- ``after``: one flat all-reduce once the backward is over (no overlap);
- ``overlap``: DDP's way: the gradients, in buckets of whole tensors of about ``bucket_mb``, are
  all-reduced while the backward still runs, each bucket as soon as its last gradient is ready;
- ``lina``: Lina's communication scheduler (§4.2, §6.1): each gradient is cut into equal micro-ops
  of about ``microop_mb`` (never two large gradients in one; small ones fused), and a micro-op is launched only while no
  MoE layer's all-to-alls are imminent (:class:`~moeflow.comm.traffic.AllToAllTraffic`: from a
  layer's combine backward to the end of its backward), so that the all-to-alls have the links to
  themselves; the ones held go when the layer's backward ends.

The bucketed and micro-op all-reduces run on their own process group (so that they truly run
beside the MoE layers' all-to-alls), in a fixed order that is the same on every rank (reverse
registration order, as DDP's first buckets), issued on the backward's own thread at points its
graph fixes (as DDP's hooks issue its buckets), so every rank enqueues them at the same places
among the all-to-alls, as NCCL requires of several communicators. On CPU tensors they run
asynchronously beside the backward; on CUDA the scheduler issues them on a communication stream of
its own, each after an event recorded when its gradients were ready, and the compute stream waits
for that stream in ``finish()``: the all-reduces overlap the backward's kernels instead of
queueing behind them on one stream. Every
piece is reduced exactly once; the averages are the same numbers as ``after``'s (the same sums of
the same values; bitwise where the reduction order agrees, e.g. on 2 workers).
"""

from __future__ import annotations

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
    each once all its gradients are ready; with ``yield_to_alltoall``, none while a layer's
    all-to-alls are imminent (Lina). :meth:`start` before the backward, :meth:`finish` after it.

    Every all-reduce is issued on the thread that runs the backward, at points the backward's graph
    fixes (a gradient becomes ready, a layer's backward ends, the backward ends), so every rank
    enqueues them among the layers' all-to-alls in the same order: NCCL's rule for several
    communicators (a thread of its own issued them wherever its timing fell, an order that differed
    by rank and can deadlock NCCL when the streams are serialised, CUDA_DEVICE_MAX_CONNECTIONS=1).
    On CPU tensors an all-reduce is asynchronous (gloo runs it beside the backward) and waited for
    in :meth:`finish`; on CUDA it runs on a stream of its own after the gradients' ready events."""

    def __init__(
        self, parameters: Sequence[nn.Parameter], pieces: Sequence[GradientPiece], group: dist.ProcessGroup,
        world_size: int, traffic: AllToAllTraffic, yield_to_alltoall: bool, ledger: CollectiveLedger | None = None,
    ) -> None:
        self.parameters, self.pieces = list(parameters), list(pieces)
        self.ledger = ledger
        self.group, self.world_size, self.traffic = group, world_size, traffic
        self.yield_to_alltoall = yield_to_alltoall
        self.launched: list[int] = []  # piece indices in launch order, this step (a test counts them)
        self._ready = [False] * len(self.parameters)
        self._running = False
        self._pending: list[tuple[GradientPiece, dist.Work | None, torch.Tensor | None]] = []
        self._ready_events: list[torch.cuda.Event | None] = [None] * len(self.parameters)
        self._stream: torch.cuda.Stream | None = None  # CUDA gradients: the all-reduces' stream
        for index, parameter in enumerate(self.parameters):
            parameter.register_post_accumulate_grad_hook(lambda _, index=index: self._mark_ready(index))
        traffic.on_settle(self._launch_ready)  # a layer's backward ended: what waited for it goes

    def start(self) -> None:
        """Before the backward: every gradient pending."""
        if self._running:
            raise RuntimeError("GradientScheduler.start() called twice without finish()")
        self.launched, self._ready, self._pending = [], [False] * len(self.parameters), []
        self._ready_events = [None] * len(self.parameters)
        self._running = True

    def finish(self) -> None:
        """After the backward: gradients that got none count as zeros, every piece is reduced
        (the rest now, with nothing left to yield to), and each gradient becomes the average."""
        if not self._running:
            raise RuntimeError("GradientScheduler.finish() without start()")
        for index, parameter in enumerate(self.parameters):
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
                if parameter.grad.is_cuda:  # the all-reduce's stream waits for the zeros too
                    self._ready_events[index] = torch.cuda.current_stream(parameter.device).record_event()
        self._ready = [True] * len(self.parameters)
        self._launch_ready(draining=True)
        self._running = False
        pending, self._pending = self._pending, []
        for piece, work, flat in pending:
            self._complete(piece, work, flat)
        if self._stream is not None:  # the averages below (and the optimizer) follow the all-reduces
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        for parameter in self.parameters:
            assert parameter.grad is not None
            parameter.grad.div_(self.world_size)

    def _mark_ready(self, index: int) -> None:
        grad = self.parameters[index].grad
        if grad is not None and grad.is_cuda:  # on the stream the backward accumulated it on
            self._ready_events[index] = torch.cuda.current_stream(grad.device).record_event()
        self._ready[index] = True
        self._launch_ready()

    def _launch_ready(self, draining: bool = False) -> None:
        """Issue, in piece order, every next piece whose gradients are all ready; with Lina's
        priority none while a layer's all-to-alls are imminent (its combine's backward began and
        its backward has not ended: a fact of the graph, the same on every rank)."""
        if not self._running or (self.yield_to_alltoall and self.traffic.imminent and not draining):
            return
        while len(self.launched) < len(self.pieces):
            index = len(self.launched)
            piece = self.pieces[index]
            if not all(self._ready[i] for i in piece.parameters):
                return
            self._pending.append(self._launch(piece))
            self.launched.append(index)

    def _launch(self, piece: GradientPiece) -> tuple[GradientPiece, dist.Work | None, torch.Tensor | None]:
        grads = [self.parameters[index].grad for index in piece.parameters]
        assert all(grad is not None for grad in grads)
        if not grads[0].is_cuda:  # type: ignore[union-attr]
            return self._issue(piece, grads)
        if self._stream is None:
            self._stream = torch.cuda.Stream(grads[0].device)  # type: ignore[union-attr]
        with torch.cuda.stream(self._stream):
            for index in piece.parameters:
                if (event := self._ready_events[index]) is not None:
                    self._stream.wait_event(event)
            return self._issue(piece, grads)

    def _issue(
        self, piece: GradientPiece, grads: list[torch.Tensor | None]
    ) -> tuple[GradientPiece, dist.Work | None, torch.Tensor | None]:
        """One all-reduce: in place on a micro-op's part of its gradient, or on a bucket's flat
        copy. Asynchronous on CPU tensors (its span ends when gloo finishes it); on CUDA its
        stream waits for it, and a bucket is copied back on that stream."""
        device = grads[0].device  # type: ignore[union-attr]
        span = self.traffic.clock.start(device)  # Lina's timeline
        if len(piece.spans) == 1:
            (_, start, stop), grad = piece.spans[0], grads[0]
            flat, reduced = None, grad.view(-1)[start:stop]  # type: ignore[union-attr]
        else:
            flat = reduced = torch.cat([grad.reshape(-1) for grad in grads])  # type: ignore[union-attr]
        work = all_reduce(reduced, self.group, async_op=device.type != "cuda")
        if work is None:  # CUDA: ordered on the stream
            span.stop()
            self.traffic.timeline.record_span("allreduce", span)
            self._copy_back(piece, flat)
            return piece, None, None
        work.get_future().add_done_callback(lambda _: span.stop())
        self.traffic.timeline.record_span("allreduce", span)
        return piece, work, flat

    def _complete(self, piece: GradientPiece, work: dist.Work | None, flat: torch.Tensor | None) -> None:
        if work is None:
            return
        nbytes = piece.numel * self.parameters[piece.parameters[0]].element_size()
        try:
            with tracked(self.ledger, "gradient all-reduce", self.group, nbytes, phase="gradient sync"):
                work.wait()
        except CollectiveError:
            raise  # its report names the all-reduce and every worker's place
        except Exception as error:
            raise RuntimeError(f"a gradient all-reduce failed: {error}") from error
        self._copy_back(piece, flat)

    def _copy_back(self, piece: GradientPiece, flat: torch.Tensor | None) -> None:
        if flat is None:
            return
        offset = 0
        for index in piece.parameters:
            grad = self.parameters[index].grad
            assert grad is not None
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


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
