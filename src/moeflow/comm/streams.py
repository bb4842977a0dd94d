"""Overlap on CUDA streams: the GPU counterpart of the communication worker thread.

On a GPU a Python thread buys nothing: both threads' kernels would queue on the default stream and
serialize. Instead the sends and receives (the all-to-alls, which NCCL orders after the stream
current when they are issued) go on a communication stream and the experts on the compute stream,
ordered by events: a chunk's experts wait for its dispatch, its combine waits for its experts.

The caching allocator hands a freed block to the next allocation on the stream that allocated it,
with no regard for other streams still reading it; ``record_stream`` marks each tensor used on the
other stream so that its block is reused only after that stream's work is done: the received rows
(made on the communication stream, read by the experts) and the experts' output (made on the
compute stream, read by the combine). The compute stream waits for the communication stream at the
end, so the input buffer and the output written there are safe in stream order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Stream(Protocol):
    """The part of ``torch.cuda.Stream`` the overlap uses (tests pass recording fakes)."""

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> Any: ...


class CommunicationStreams:
    """One communication stream per CUDA device, made on first use (a layer's groups own one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def on(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]


Piece = torch.Tensor | tuple[torch.Tensor, ...]
"""What a pipeline's send, compute or receive hands on: a tensor, or a piece's tensors."""


def _used_on(value: Piece, stream: Stream) -> None:
    """``value`` (a tensor, or a piece's tensors) read on ``stream`` too."""
    for tensor in value if isinstance(value, tuple) else (value,):
        if tensor.is_cuda:
            tensor.record_stream(stream)  # type: ignore[arg-type]


def overlap_on_streams(
    comm: Stream, compute_stream: Stream, sends: list[Callable[[], Piece]],
    compute: Callable[[int, Piece], Piece], receive: Callable[[int, Piece], None],
    after_compute: Callable[[], None] | None = None,
    on_stream: Callable[[Stream], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    """The pipeline's overlap on streams: every send on ``comm`` in order; piece i's compute on
    ``compute_stream`` after its send; its receive on ``comm`` after its compute, queued behind
    the sends; ``after_compute`` on the compute stream while the last receives run."""
    use = on_stream or torch.cuda.stream
    comm.wait_stream(compute_stream)  # the buffer the sends read is complete
    received: list[tuple[Piece, Any]] = []
    with use(comm):
        for send in sends:
            rows = send()
            received.append((rows, comm.record_event()))
    # every piece's output stays referenced until the receives are done: an output may be a
    # workspace buffer, which the workspace hands out again as soon as nothing references it,
    # and record_stream cannot guard a block that never goes back to the caching allocator
    outputs: list[Piece] = []
    for index, (rows, sent) in enumerate(received):
        compute_stream.wait_event(sent)
        _used_on(rows, compute_stream)
        outputs.append(compute(index, rows))
        computed = compute_stream.record_event()
        with use(comm):
            comm.wait_event(computed)
            _used_on(outputs[-1], comm)
            receive(index, outputs[-1])
    if after_compute is not None:
        after_compute()
    compute_stream.wait_stream(comm)  # the output buffer is written; the input no longer read
    outputs.clear()

