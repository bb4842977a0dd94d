"""Faults injected into a job on purpose, for the tests of what the job does about them.

The plan is passed in (``run_training(..., faults=FaultPlan(...))``, carried by the job to every
worker), never read from the environment: a run without one has no fault path at all. A worker
fault fires as the worker enters its first collective of the named phase (the collective ledger's
``on_enter``, :mod:`moeflow.comm.ledger`): it kills the worker, stops it, or holds it a while.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.comm.ledger import CollectiveLedger, LedgerEntry

FAULT_KINDS = ("kill", "stop", "delay")
"""``kill``: SIGKILL (a crash, the OOM killer); ``stop``: SIGSTOP (a deadlock, a stuck device, a
paused machine); ``delay``: the worker sleeps, then goes on (a slow worker)."""
FAULT_PHASES = ("forward", "backward", "gradient sync", "checkpoint", "evaluation", "generation")
"""Where a fault fires: a training forward's or backward's all-to-alls, the gradient all-reduce,
the checkpoint save, the evaluation's forwards, a generation's forwards."""


@dataclass(frozen=True)
class WorkerFault:
    """``kind`` on worker ``rank`` at its first collective of ``phase`` in ``step`` (None: any step)."""

    kind: str
    rank: int
    phase: str
    step: int | None = None
    seconds: float = 0.0  # a delay's length

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind={self.kind!r}; choose one of {', '.join(FAULT_KINDS)}")
        if self.phase not in FAULT_PHASES:
            raise ValueError(f"phase={self.phase!r}; choose one of {', '.join(FAULT_PHASES)}")

    def matches(self, rank: int, entry: LedgerEntry) -> bool:
        """Whether worker ``rank`` entering ``entry`` is where this fault fires."""
        return rank == self.rank and entry.phase == self.phase and self.step in (None, entry.location.step)

    def fire(self) -> None:
        """Kill or stop this process, or hold it for ``seconds``."""
        if self.kind == "delay":
            time.sleep(self.seconds)
        else:
            os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)


@dataclass(frozen=True)
class FaultPlan:
    """``nonfinite_loss``: (rank, step) pairs whose training loss becomes NaN, as an overflow or a
    bad batch would make it; ``workers``: faults that kill, stop or delay a worker."""

    nonfinite_loss: tuple[tuple[int, int], ...] = ()
    workers: tuple[WorkerFault, ...] = ()

    def loss(self, loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
        """``loss``, or NaN in its place where the plan says so (the graph stays: the backward runs)."""
        return loss * float("nan") if (rank, step) in self.nonfinite_loss else loss

    def injector(self, rank: int) -> Callable[[LedgerEntry], None] | None:
        """The ledger hook of worker ``rank``: each of its faults fires once, at its first match."""
        pending = [fault for fault in self.workers if fault.rank == rank]
        if not pending:
            return None

        def inject(entry: LedgerEntry) -> None:
            for fault in [fault for fault in pending if fault.matches(rank, entry)]:
                pending.remove(fault)
                fault.fire()

        return inject


def worker_ledger(rank: int, world_size: int, progress_dir: Path, faults: FaultPlan | None) -> CollectiveLedger:
    """A spawned worker's ledger: its progress file in ``progress_dir``, and the faults the plan
    (if any) injects into worker ``rank``."""
    injector = faults.injector(rank) if faults is not None else None
    return CollectiveLedger(rank, world_size, progress_dir, on_enter=injector)
