"""Which clock times work (moeflow.comm.clock): the host clock for CPU tensors, CUDA events for CUDA
ones, in Lina's all-to-all accounting and in the calibration's timers. The CUDA branch runs here
against stand-in events on a fake device clock (tests/test_gpu_calibrate.py runs the real one)."""

from __future__ import annotations

import time

import pytest
import torch

from moeflow.comm.clock import DeviceClock, DeviceSpan, HostSpan, start_span
from moeflow.comm.traffic import AllToAllTraffic, contention_seconds
from moeflow.timing.measure import device_medians, sample_seconds


class FakeDevice:
    """A device clock that only moves when the test says so, and the events that read it."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.syncs = 0
        self.pending: list[FakeEvent] = []  # recorded, not yet run (until run_queued)

    def run_queued(self) -> None:
        for event in self.pending:
            event.done = True
        self.pending.clear()


class FakeEvent:
    device: FakeDevice

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at_s: float | None = None
        self.done = False

    def record(self, stream: object = None) -> None:
        self.at_s = self.device.now_s
        self.device.pending.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.device.run_queued()

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "elapsed_time of an event that has not run"
        return (end.at_s - self.at_s) * 1e3  # milliseconds, as CUDA's


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    device = FakeDevice()
    FakeEvent.device = device

    def synchronize(_device: object = None) -> None:
        device.syncs += 1
        device.run_queued()

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda _device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return device


def test_cpu_tensors_use_the_host_clock() -> None:
    assert isinstance(start_span(torch.device("cpu")), HostSpan)
    assert isinstance(start_span(None), HostSpan)
    span = start_span(torch.zeros(1).device)
    time.sleep(0.02)
    span.stop()
    assert span.done() and 0.02 <= span.seconds() < 1.0
    start, stop = span.interval()
    assert stop - start == span.seconds()
    assert isinstance(DeviceClock().start(torch.device("cpu")), HostSpan)
    assert 0.02 <= sample_seconds(lambda: time.sleep(0.02), torch.device("cpu")) < 1.0


def test_cuda_tensors_use_events_read_when_the_work_is_done(fake_cuda: FakeDevice) -> None:
    span = start_span(torch.device("cuda", 0))
    assert isinstance(span, DeviceSpan)
    fake_cuda.now_s += 0.25  # the device runs the work; the host returned at once
    span.stop()
    assert not span.done()  # queued, not run: reading does not synchronize the device ...
    assert span.seconds() == pytest.approx(0.25)  # ... it waits for the end event
    assert span.done() and fake_cuda.syncs == 0
    with pytest.raises(ValueError, match="anchor"):  # no host time without an anchor
        span.interval()


def test_device_clock_anchors_each_device_once(fake_cuda: FakeDevice) -> None:
    device_clock = DeviceClock()
    first = device_clock.start(torch.device("cuda"))  # no index: the current device
    fake_cuda.now_s += 0.5
    first.stop()
    second = device_clock.start(torch.device("cuda", 0))
    fake_cuda.now_s += 0.125
    second.stop()
    assert fake_cuda.syncs == 1  # the anchor's one wait for the device
    assert isinstance(first, DeviceSpan) and first.anchor is second.anchor is not None
    start, stop = second.interval()
    assert start == pytest.approx(first.anchor.host_s + 0.5) and stop - start == pytest.approx(0.125)


def test_lina_alltoall_times_on_cuda_are_device_times(fake_cuda: FakeDevice) -> None:
    """The all-to-all seconds Lina's packing reads and the timeline's events are the device's, not
    the time to queue the collective."""
    traffic = AllToAllTraffic()
    traffic.timeline.enabled = True
    with traffic.running(torch.device("cuda", 0)):
        fake_cuda.now_s += 0.2
    with traffic.running(torch.device("cuda", 0)):
        fake_cuda.now_s += 0.1
    assert traffic.alltoall_ops == 2 and traffic.clear
    assert traffic.alltoall_seconds == pytest.approx(0.3)
    assert traffic.alltoall_seconds == pytest.approx(0.3)  # read once, counted once
    events = traffic.timeline.take()
    assert [e.kind for e in events] == ["alltoall", "alltoall"]
    assert [e.seconds for e in events] == pytest.approx([0.2, 0.1])
    assert contention_seconds(events)["all_to_all_alone"] == pytest.approx(0.3)


def test_lina_alltoall_times_on_cpu_are_host_times() -> None:
    traffic = AllToAllTraffic()
    traffic.timeline.enabled = True
    with traffic.running(torch.device("cpu")):
        time.sleep(0.02)
    with traffic.running():  # no device: the host clock
        pass
    assert traffic.alltoall_ops == 2 and 0.02 <= traffic.alltoall_seconds < 1.0
    assert [e.kind for e in traffic.timeline.take()] == ["alltoall", "alltoall"]


def test_unread_device_spans_are_folded_once_run(fake_cuda: FakeDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that never reads the total keeps a bounded number of spans (their events)."""
    monkeypatch.setattr("moeflow.comm.traffic._UNREAD_SPANS", 4)
    traffic = AllToAllTraffic()
    for _ in range(10):
        with traffic.running(torch.device("cuda", 0)):
            fake_cuda.now_s += 0.01
        fake_cuda.run_queued()
    assert len(traffic._unread) <= 5
    assert traffic.alltoall_seconds == pytest.approx(0.1) and traffic.alltoall_ops == 10


def test_device_medians_on_cuda_idle_the_device_then_time_with_events(fake_cuda: FakeDevice) -> None:
    def work() -> None:
        fake_cuda.now_s += 0.003

    medians = device_medians({"work": work}, torch.device("cuda", 0), repeats=3, warmup=1)
    assert medians["work"] == pytest.approx(0.003)
    assert fake_cuda.syncs == 4  # the device idle before each of the 4 samples
