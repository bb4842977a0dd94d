"""The CUDA-stream overlap: sends and receives on the communication stream, experts on the compute
stream, ordered by events. The ordering is checked on CPU with recording streams; on a GPU the
pipeline runs on real streams and equals the unpipelined result."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from moeflow.comm.streams import overlap_on_streams


@dataclass
class Log:
    entries: list[tuple] = field(default_factory=list)
    current: list[str] = field(default_factory=lambda: ["compute"])
    events: int = 0


@dataclass
class RecordingStream:
    name: str
    log: Log

    def wait_stream(self, stream: RecordingStream) -> None:
        self.log.entries.append(("wait_stream", self.name, stream.name))

    def wait_event(self, event: int) -> None:
        self.log.entries.append(("wait_event", self.name, event))

    def record_event(self, event: object = None) -> int:
        self.log.events += 1
        self.log.entries.append(("record", self.name, self.log.events))
        return self.log.events


def _run(pieces: int) -> tuple[Log, list[torch.Tensor], list[torch.Tensor]]:
    log = Log()
    comm, compute_stream = RecordingStream("comm", log), RecordingStream("compute", log)

    @contextlib.contextmanager
    def on_stream(stream: RecordingStream) -> Iterator[None]:
        log.current.append(stream.name)
        yield
        log.current.pop()

    inputs = [torch.full((2,), float(i)) for i in range(pieces)]
    received: list[torch.Tensor] = [torch.empty(0)] * pieces

    def send(i: int) -> torch.Tensor:
        log.entries.append(("send", log.current[-1], i))
        return inputs[i] + 1

    def compute(i: int, rows: torch.Tensor) -> torch.Tensor:
        log.entries.append(("compute", log.current[-1], i))
        return rows * 10

    def receive(i: int, out: torch.Tensor) -> None:
        log.entries.append(("receive", log.current[-1], i))
        received[i] = out

    overlap_on_streams(comm, compute_stream, [lambda i=i: send(i) for i in range(pieces)], compute, receive,
                       lambda: log.entries.append(("after", log.current[-1], None)), on_stream)
    return log, inputs, received


def _event_after(entries: list[tuple], kind: str, index: int) -> int:
    position = entries.index((kind, "comm" if kind != "compute" else "compute", index))
    record = entries[position + 1]
    assert record[0] == "record", f"no event recorded right after {kind} {index}"
    return record[2]


def test_sends_and_receives_on_the_comm_stream_experts_on_the_compute_stream_ordered_by_events() -> None:
    log, inputs, received = _run(3)
    entries = log.entries
    assert entries[0] == ("wait_stream", "comm", "compute")  # the sends read a complete buffer
    assert entries[-1] == ("wait_stream", "compute", "comm")  # the caller sees every receive done
    assert [e[2] for e in entries if e[0] == "send"] == [0, 1, 2]
    assert {e[1] for e in entries if e[0] in ("send", "receive")} == {"comm"}
    assert {e[1] for e in entries if e[0] in ("compute", "after")} == {"compute"}
    for i in range(3):
        compute_at = entries.index(("compute", "compute", i))
        assert ("wait_event", "compute", _event_after(entries, "send", i)) in entries[:compute_at]
        receive_at = entries.index(("receive", "comm", i))
        assert ("wait_event", "comm", _event_after(entries, "compute", i)) in entries[:receive_at]
    # every send is issued before the first compute: the dispatches queue ahead on the comm stream
    assert max(entries.index(("send", "comm", i)) for i in range(3)) < entries.index(("compute", "compute", 0))
    assert entries.index(("after", "compute", None)) > entries.index(("receive", "comm", 2))
    for i in range(3):
        torch.testing.assert_close(received[i], (inputs[i] + 1) * 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_pipeline_on_cuda_streams_equals_the_unpipelined_experts() -> None:
    """An exchange that communicates through pinned host copies on the communication stream (one GPU, no peer)."""
    from moeflow.bench.overlap import CopyExchange
    from moeflow.comm import ParallelGroups
    from moeflow.core.experts import FFNCompute, FFNWeights
    from moeflow.parallel.chunk_pipeline import pipelined_experts

    torch.manual_seed(0)
    device = torch.device("cuda")
    weights = FFNWeights(*(torch.randn(shape, device=device, requires_grad=True) * 0.1 for shape in
                           ((4, 64, 96), (4, 96), (4, 96, 64), (4, 64))))
    buffer = torch.randn(4, 256, 64, device=device, requires_grad=True)
    chunk_exchange = CopyExchange(ParallelGroups.single_process())
    outputs = []
    for degree in (1, 4):
        y = pipelined_experts(buffer, FFNCompute(), weights, chunk_exchange, degree)
        params = [buffer, *(w for w in weights.as_tuple() if w is not None)]  # w3 is SwiGLU's alone
        grads = torch.autograd.grad(y.square().sum(), params)
        outputs.append((y, *grads))
    for single, pipelined in zip(*outputs, strict=True):
        torch.testing.assert_close(pipelined, single, rtol=1e-5, atol=1e-5)
