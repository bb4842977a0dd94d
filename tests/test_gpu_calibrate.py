"""The GPU's calibration and Lina's device timing: ``moeflow calibrate --device cuda`` writes a
profile of the GPU that ``moeflow plan --profile`` reads, and CUDA events time the work, not the
enqueue. Skipped without a GPU (the CPU side is in tests/test_clock.py and tests/test_perf.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeflow.distributed import free_port

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep: tens of milliseconds of a busy device, queued in microseconds
CALIBRATE_ARGS = ["--repeats", "2"]  # the GPU's default dimensions (256 x 512 was launch-bound: a flat GEMM fit)
PLAN_ARGS = ["--tokens", "1024", "--model-dim", "256", "--hidden-dim", "512", "--num-experts", "8"]


@cuda
def test_cuda_span_times_the_work_not_the_enqueue() -> None:
    from moeflow.comm.clock import start_span

    device = torch.device("cuda", 0)
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    span = start_span(device)
    torch.cuda._sleep(SLEEP_CYCLES)
    span.stop()
    queued_s = time.perf_counter() - began
    device_s = span.seconds()
    assert device_s > 5e-3 and queued_s < device_s / 2, (device_s, queued_s)


@cuda
def test_lina_alltoall_seconds_on_cuda_are_device_seconds() -> None:
    """The all-to-all time Lina's packing reads, and the timeline's event, are the device's."""
    from moeflow.comm.traffic import AllToAllTraffic

    device = torch.device("cuda", 0)
    traffic = AllToAllTraffic()
    traffic.timeline.enabled = True
    began = time.perf_counter()
    with traffic.running(device):
        torch.cuda._sleep(SLEEP_CYCLES)
    queued_s = time.perf_counter() - began  # includes the anchor's one wait for an idle device
    seconds = traffic.alltoall_seconds
    (event,) = traffic.timeline.take()
    assert seconds > 5e-3 and queued_s < seconds / 2, (seconds, queued_s)
    assert event.kind == "alltoall" and event.seconds == pytest.approx(seconds, rel=1e-3)
    assert began <= event.start_s < event.stop_s <= time.perf_counter()


def _moeflow(tmp_path: Path, *args: str, launcher: list[str] | None = None) -> list[dict]:
    result = subprocess.run([sys.executable, *(launcher or []), "-m", "moeflow", *args], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "MOEFLOW_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@cuda
@pytest.mark.parametrize("launched", [False, True], ids=["one-process", "torchrun"])
def test_calibrate_cuda_writes_a_profile_that_plan_reads(tmp_path: Path, launched: bool) -> None:
    from moeflow.perf import ClusterProfile
    from moeflow.perf.profile import NOT_MEASURED

    profile_path = tmp_path / "profile.json"
    launcher = (["-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}"]
                if launched else None)
    lines = _moeflow(tmp_path, "calibrate", "--device", "cuda", "--out", str(profile_path), *CALIBRATE_ARGS,
                     launcher=launcher)
    summary = lines[-1]
    assert summary["summary"] == "calibrate" and summary["device"]["kind"] == "cuda"
    profile = ClusterProfile.load(profile_path)
    assert profile.device.kind == "cuda" and profile.device.name == torch.cuda.get_device_name(0)
    assert profile.device.dtype == "fp32" and profile.device.collectives == NOT_MEASURED  # one GPU
    assert {"gemm", "ffn.forward", "ffn.backward", "encode", "decode", "layer.forward", "layer.backward"} == set(
        profile.fits)
    assert profile.machine["gpu"] == profile.device.name and profile.fits["gemm"].beta > 0
    # the device's GEMM, not the host's: an H100/H200 multiplies at > 1 TFLOP/s even at these sizes
    assert 2.0 / profile.fits["gemm"].beta > 1e12
    plan = _moeflow(tmp_path, "plan", "--profile", str(profile_path), *PLAN_ARGS)[-1]
    assert plan["summary"] == "plan" and plan["world_size"] == 1 and plan["predicted_ms"] > 0
    assert plan["profile_device"] == profile.device.to_dict()
