"""How long work on a device took: the host clock for CPU tensors, CUDA events for CUDA tensors.

On CUDA a call returns once its kernels (or an NCCL collective) are queued, so the host clock
around it measures the enqueue, not the work. A :class:`DeviceSpan` records an event on the
current stream before and after the work and reads the time between them once the second has
completed: without a synchronize at the end of the span, so the caller keeps queueing. What the
work depends on that was queued before (on the same stream) is not in the span: the events
bracket what ran on that stream in between, including a collective's wait on its own stream.

Used by Lina's all-to-all accounting (:mod:`moeflow.comm.traffic`), the gradient all-reduces of
the trainer and the calibration's timers (:mod:`moeflow.timing.measure`).
"""

from __future__ import annotations

import threading
import time

import torch


class HostSpan:
    """Work timed by the host clock (``time.perf_counter``): CPU tensors, where a call returns
    when its work is done."""

    def __init__(self) -> None:
        self.start_s = time.perf_counter()
        self.stop_s: float | None = None

    def stop(self) -> None:
        self.stop_s = time.perf_counter()

    def done(self) -> bool:
        return self.stop_s is not None

    def seconds(self) -> float:
        assert self.stop_s is not None, "the span was not stopped"
        return self.stop_s - self.start_s

    def interval(self) -> tuple[float, float]:
        """Start and stop on the host clock."""
        assert self.stop_s is not None, "the span was not stopped"
        return self.start_s, self.stop_s


class DeviceAnchor:
    """A CUDA event completed at a known host time, which places later events of its device on
    the host clock (a timeline draws device spans beside host ones). Making one waits for the
    device once."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(torch.cuda.current_stream(device))
        self.event.synchronize()
        self.host_s = time.perf_counter()

    def host_time(self, event: torch.cuda.Event) -> float:
        """When ``event`` (recorded after the anchor, on its device) completed, on the host clock."""
        event.synchronize()
        return self.host_s + self.event.elapsed_time(event) / 1e3


class DeviceSpan:
    """Work on a CUDA device timed by two events on the stream current at :meth:`stop` and at the
    start (the same stream, as inside one ``torch.cuda.stream`` block); :meth:`seconds` waits for
    the second event, not for the device."""

    def __init__(self, device: torch.device, anchor: DeviceAnchor | None = None) -> None:
        self.device = device
        self.anchor = anchor
        self.began = torch.cuda.Event(enable_timing=True)
        self.ended = torch.cuda.Event(enable_timing=True)
        self.began.record(torch.cuda.current_stream(device))

    def stop(self) -> None:
        self.ended.record(torch.cuda.current_stream(self.device))

    def done(self) -> bool:
        """Whether the work has run (the end event completed); never waits."""
        return self.ended.query()

    def seconds(self) -> float:
        self.ended.synchronize()
        return self.began.elapsed_time(self.ended) / 1e3

    def interval(self) -> tuple[float, float]:
        """Start and stop on the host clock, through the span's anchor."""
        if self.anchor is None:
            raise ValueError("a device span without an anchor: start it from a DeviceClock to place it on the host")
        return self.anchor.host_time(self.began), self.anchor.host_time(self.ended)


Span = HostSpan | DeviceSpan


def start_span(device: torch.device | None, anchor: DeviceAnchor | None = None) -> Span:
    """A span that starts now: CUDA events on a CUDA ``device``'s current stream, else the host
    clock (CPU tensors, or ``None``: no device)."""
    if device is not None and device.type == "cuda":
        return DeviceSpan(device, anchor)
    return HostSpan()


class DeviceClock:
    """Spans whose intervals share the host clock: one :class:`DeviceAnchor` per CUDA device,
    made on that device's first span (its one wait for the device)."""

    def __init__(self) -> None:
        self._anchors: dict[torch.device, DeviceAnchor] = {}
        self._lock = threading.Lock()

    def start(self, device: torch.device | None) -> Span:
        if device is None or device.type != "cuda":
            return HostSpan()
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        with self._lock:
            anchor = self._anchors.get(device)
            if anchor is None:
                anchor = self._anchors[device] = DeviceAnchor(device)
        return DeviceSpan(device, anchor)
