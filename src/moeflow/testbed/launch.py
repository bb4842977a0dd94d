"""``moeflow launch``: start N x G ranks inside an emulated cluster, the way torchrun starts them.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and
GLOO_SOCKET_IFNAME (its node's link), runs in its node's namespace, and has its output streamed
with a ``[rank r]`` prefix. The first rank that fails gives the others a short grace period, then
all are stopped; the worst exit code is returned. The cluster is torn down on every path,
including Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from moeflow.testbed.cluster import ClusterSpec, EmulatedCluster

FAILURE_GRACE_S = 5.0


def _pump(stream: TextIO, prefix: str, sink: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sink.write(f"{prefix}{line}" if line.endswith("\n") else f"{prefix}{line}\n")
            sink.flush()
    stream.close()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal s -> 128 + s, as shells report it


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


def launch(
    spec: ClusterSpec,
    command: Sequence[str],
    *,
    master_port: int = 29500,
    timeout_s: float | None = None,
    sink: TextIO | None = None,
) -> int:
    """Run ``command`` as every rank of an emulated cluster; return the worst exit code
    (124 when ``timeout_s`` passes)."""
    if not command:
        raise ValueError("launch needs a command to run, after --")
    sink = sink or sys.stdout
    lock = threading.Lock()
    previous_term = signal.getsignal(signal.SIGTERM)

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    processes: list[subprocess.Popen[str]] = []
    pumps: list[threading.Thread] = []
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        with EmulatedCluster(spec) as cluster:
            for rank in range(spec.world_size):
                node, local_rank = divmod(rank, spec.ranks_per_node)
                env = {
                    **os.environ,
                    "RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
                    "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(spec.ranks_per_node),
                    "GROUP_RANK": str(node), "MASTER_ADDR": cluster.address(0), "MASTER_PORT": str(master_port),
                    "GLOO_SOCKET_IFNAME": cluster.interface(node),
                    "MOEFLOW_TESTBED_LATENCY_EMULATED": str(int(cluster.latency_emulated)),
                }
                process = subprocess.Popen(
                    [*cluster.exec_prefix(node), *command], env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True,
                )
                processes.append(process)
                pump = threading.Thread(target=_pump, args=(process.stdout, f"[rank {rank}] ", sink, lock), daemon=True)
                pump.start()
                pumps.append(pump)
            return _wait(processes, timeout_s, sink, lock)
    finally:
        _stop(processes)
        for pump in pumps:
            pump.join(timeout=5)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous_term)


def _wait(processes: list[subprocess.Popen[str]], timeout_s: float | None, sink: TextIO, lock: threading.Lock) -> int:
    start = time.monotonic()
    failed_at: float | None = None
    while True:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes):
            return max(_exit_code(code) for code in codes if code is not None)
        failures = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        now = time.monotonic()
        if failures and failed_at is None:
            failed_at = now
            with lock:
                sink.write(f"moeflow launch: rank {failures[0]} exited with code {codes[failures[0]]}; "
                           f"stopping the others in {FAILURE_GRACE_S:.0f} s\n")
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            # the ranks that failed on their own name the exit code, not the ones stopped here
            own_failures = [_exit_code(code) for code in codes if code not in (None, 0)]
            _stop(processes)
            return max(own_failures)
        if timeout_s is not None and now - start > timeout_s:
            with lock:
                sink.write(f"moeflow launch: timed out after {timeout_s:.0f} s; stopping all ranks\n")
            _stop(processes)
            return 124
        time.sleep(0.05)
