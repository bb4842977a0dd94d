"""Each rank's record of its collectives, so that a hang says where every rank stopped.

A :class:`CollectiveLedger` belongs to one :class:`~moeflow.comm.groups.ParallelGroups` value (no
global state). Every tracked collective enters it before it starts and finishes it after: its
number on its group (the same on every rank of the group, as NCCL's flight recorder counts),
the operation, the bytes, and where the job was (step, phase, layer, forward or backward). The
last entries are kept in a small ring buffer.

With a progress directory, the ledger also mirrors where it is into a small memory-mapped file
per rank (:class:`ProgressBeacon`): a peer that is stopped (SIGSTOP, a debugger, a stuck device)
or killed cannot answer, but its file still says what it last entered and finished. When a
collective fails or times out, the rank that saw it reads every peer's file and raises a
:class:`CollectiveError` naming the rank that is behind, or the desync when two ranks wait in
different operations.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

RING_ENTRIES = 16
"""How many of its last collectives a ledger keeps in memory."""
BEACON_BYTES = 8192
"""The size of a rank's progress file (a few open entries and one entry per group)."""


class CollectiveError(RuntimeError):
    """A tracked collective failed or timed out; the message says where every rank was."""


@dataclass
class Location:
    """Where the job is: set by the driver (step, phase) and by the MoE layer (layer, direction)."""

    step: int | None = None
    phase: str | None = None  # "training", "evaluation", "checkpoint", "generation"... (None: a user's loop)
    layer: int | None = None
    direction: str | None = None  # "forward" or "backward" inside a layer


@dataclass
class LedgerEntry:
    """One collective: its number on its group and where the job was when it entered."""

    seq: int
    group: str
    operation: str
    nbytes: int
    location: Location
    entered: float  # wall-clock seconds (time.time), comparable between the processes of a machine
    finished: float | None = None

    @property
    def phase(self) -> str | None:
        """What a fault plan names: ``forward``/``backward`` in training, else the driver's phase."""
        where = self.location
        return where.direction if where.phase in (None, "training") else where.phase

    def describe(self) -> str:
        """``forward all-to-all of layer 3, step 57`` (what a person reads in the report)."""
        where = self.location
        text = f"{where.direction} {self.operation}" if where.direction else self.operation
        if where.layer is not None:
            text += f" of layer {where.layer}"
        if where.phase not in (None, "training") and where.phase not in self.operation:
            text += f" ({where.phase})"
        if where.step is not None:
            text += f", step {where.step}"
        return text


@dataclass
class CollectiveLedger:
    """The ring buffer of one rank's collectives, and (with ``directory``) its progress file.
    ``on_enter`` is called with every entry as it is entered (a test's fault injector)."""

    rank: int = 0
    world_size: int = 1
    directory: Path | None = None
    on_enter: Callable[[LedgerEntry], None] | None = None
    location: Location = field(default_factory=Location)
    entries: deque[LedgerEntry] = field(default_factory=lambda: deque(maxlen=RING_ENTRIES))
    bytes_by_layer: dict[int | None, int] = field(default_factory=dict)  # handed to collectives, by the layer there

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {}
        self._open: dict[int, str] = {}  # the open entries' JSON, for the progress file
        self._last: dict[str, str] = {}  # each group's last entered entry's JSON
        self._done: dict[str, int] = {}  # each group's last finished number
        self._pid = os.getpid()
        self._names: dict[int, str] = {}
        self._beacon = None if self.directory is None else ProgressBeacon.create(self.directory, self.rank)

    @contextmanager
    def tracked(
        self, operation: str, group: dist.ProcessGroup | None, nbytes: int = 0, phase: str | None = None
    ) -> Iterator[LedgerEntry]:
        """Enter ``operation`` on ``group``; finish it when the block ends. A block that raises
        raises a :class:`CollectiveError` saying where every rank is (a RuntimeError, as torch's
        backends raise on a timeout or a lost peer; other errors pass unchanged). ``phase`` names an operation
        of the driver's (a gradient sync): no layer's."""
        entry = self._enter(operation, self._group_name(group), nbytes, phase)
        if self.on_enter is not None:
            self.on_enter(entry)
        try:
            yield entry
        except CollectiveError:
            raise  # an inner tracked collective's report says it already; the entry stays open
        except RuntimeError as error:  # stays open: peers reading the progress file see it waited here
            raise CollectiveError(self.report(entry, error)) from error
        except BaseException:
            self._finish(entry)
            raise
        self._finish(entry)

    def at(self, **where: Any) -> AbstractContextManager[None]:
        """Set fields of the location for the block (``ledger.at(phase="evaluation")``), then put
        the previous values back."""
        return _At(self.location, where)

    def _enter(self, operation: str, group: str, nbytes: int, phase: str | None) -> LedgerEntry:
        with self._lock:
            seq = self._seq.get(group, 0) + 1
            self._seq[group] = seq
            here = replace(self.location) if phase is None else Location(self.location.step, phase)
            entry = LedgerEntry(seq, group, operation, nbytes, here, time.time())
            self.entries.append(entry)
            self.bytes_by_layer[here.layer] = self.bytes_by_layer.get(here.layer, 0) + nbytes
            if self._beacon is not None:
                text = _entry_text(entry)
                self._open[id(entry)] = text
                self._last[group] = text
                self._mirror()
        return entry

    def _finish(self, entry: LedgerEntry) -> None:
        with self._lock:
            entry.finished = time.time()
            if self._beacon is not None:
                self._open.pop(id(entry), None)
                self._done[entry.group] = max(entry.seq, self._done.get(entry.group, 0))
                self._mirror()

    def _mirror(self) -> None:
        """The progress file: this rank's open entries, the last entered and the last finished
        number per group (JSON assembled from each entry's text, made once)."""
        assert self._beacon is not None
        last = ",".join(f"{json.dumps(group)}:{text}" for group, text in self._last.items())
        self._beacon.write(
            f'{{"rank":{self.rank},"pid":{self._pid},"updated":{time.time()},"open":[{",".join(self._open.values())}],'
            f'"last":{{{last}}},"done":{json.dumps(self._done)}}}'
        )

    def _group_name(self, group: dist.ProcessGroup | None) -> str:
        """``group 2 (ranks 0-3)``: torch's name of the group (the same on all its ranks; two groups
        of the same ranks count apart) and its global ranks, worked out once per group."""
        if group is None:
            return "local"
        key = id(group)
        if key not in self._names:
            self._names[key] = f"group {group.group_name} ({_ranks_text(dist.get_process_group_ranks(group))})"
        return self._names[key]

    def report(self, entry: LedgerEntry, error: BaseException) -> str:
        """Where this rank and every peer with a progress file stopped, and who is behind."""
        waited = time.time() - entry.entered
        lines = [
            f"worker {self.rank} of {self.world_size}: {entry.describe()} (collective #{entry.seq} on "
            f"{entry.group}, {entry.nbytes} bytes) failed after {waited:.1f} s: {str(error).splitlines()[0]}"
        ]
        if self.directory is None:
            lines.append("the other workers' progress is unknown (no progress directory)")
            return "\n".join(lines)
        for peer in range(self.world_size):
            if peer != self.rank:
                beacon = ProgressBeacon.read(self.directory, peer)
                lines.append(_peer_line(peer, self.rank, self.world_size, beacon, entry))
        return "\n".join(lines)


def tracked(
    ledger: CollectiveLedger | None, operation: str, group: dist.ProcessGroup | None, nbytes: int = 0,
    phase: str | None = None,
) -> AbstractContextManager[object]:
    """``ledger.tracked(...)``, or nothing for a caller without a ledger."""
    return nullcontext() if ledger is None else ledger.tracked(operation, group, nbytes, phase)


def _ranks_text(ranks: list[int]) -> str:
    contiguous = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    return f"ranks {ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 2 else f"ranks {','.join(map(str, ranks))}"


def _entry_text(entry: LedgerEntry) -> str:
    """An entry as a compact JSON list (what the progress file holds; :func:`_entry` reads it)."""
    where = entry.location
    return json.dumps([entry.seq, entry.group, entry.operation, entry.nbytes, where.step, where.phase, where.layer,
                       where.direction, entry.entered])


def _entry(record: list[Any], done: dict[str, int]) -> LedgerEntry:
    """An entry read back from a progress file (finished when its group's last finished number
    reached it; the time is not kept)."""
    seq, group, operation, nbytes, step, phase, layer, direction, entered = record
    entry = LedgerEntry(seq, group, operation, nbytes, Location(step, phase, layer, direction), entered)
    entry.finished = entered if seq <= done.get(group, 0) else None
    return entry


def _open_entries(beacon: dict[str, Any]) -> list[LedgerEntry]:
    """The entries a progress file lists as entered and not finished."""
    return [_entry(record, beacon.get("done", {})) for record in beacon["open"]]


def _peer_line(peer: int, rank: int, world_size: int, beacon: dict[str, Any] | None, mine: LedgerEntry) -> str:
    """One peer's line: behind (no progress), in a different collective (desync), or waiting too."""
    name = f"worker {peer} of {world_size}"
    if beacon is None:
        return f"{name} left no progress record (it never reached a tracked collective)"
    name += {"stopped": " is stopped (SIGSTOP, a debugger or a paused machine);", "gone": " has exited;"}.get(
        process_state(int(beacon["pid"])), "")
    idle = time.time() - float(beacon["updated"])
    done = beacon.get("done", {})
    open_entries = _open_entries(beacon)
    last = beacon["last"].get(mine.group)  # [seq, ...]
    latest = max((_entry(record, done) for record in beacon["last"].values()), key=lambda e: e.entered, default=None)
    same_slot = [e for e in open_entries if e.group == mine.group and e.seq == mine.seq]
    if same_slot and same_slot[0].operation == mine.operation and same_slot[0].location == mine.location:
        return f"{name} entered the same collective ({same_slot[0].describe()}) {idle:.1f} s ago"
    if same_slot or (open_entries and (last is None or int(last[0]) < mine.seq)):
        other = (same_slot or open_entries)[0]
        return (f"desync: {name} waits in {other.describe()} (collective #{other.seq} on {other.group}) "
                f"while worker {rank} waits in {mine.describe()}")
    if last is None or int(last[0]) < mine.seq:
        entered = "nothing tracked" if latest is None else (
            f"{latest.describe()}" + (" (finished)" if latest.finished is not None else " (not finished)"))
        return f"{name} made no progress for {idle:.0f} s; last entered: {entered}"
    return f"{name} passed collective #{mine.seq} on {mine.group}; it was last seen {idle:.0f} s ago"


def process_state(pid: int | None) -> str:
    """``stopped`` (state T or t in Linux's /proc), ``gone`` (no such process, or a zombie),
    ``running``, or ``unknown`` where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "unknown"
    return "stopped" if state in ("T", "t") else "gone" if state in ("Z", "X") else "running"


@dataclass
class ProgressBeacon:
    """A rank's progress file: one JSON object, rewritten in place in a memory map (no system call
    per write), readable while its process is stopped or after it died."""

    path: Path
    _map: mmap.mmap

    @classmethod
    def create(cls, directory: Path, rank: int) -> ProgressBeacon:
        """Rank ``rank``'s file in ``directory``, emptied and mapped."""
        directory.mkdir(parents=True, exist_ok=True)
        path = cls.path_of(directory, rank)
        with open(path, "wb") as file:
            file.write(b" " * BEACON_BYTES)
        with open(path, "r+b") as file:
            return cls(path, mmap.mmap(file.fileno(), BEACON_BYTES))

    @staticmethod
    def path_of(directory: Path, rank: int) -> Path:
        """Where rank ``rank``'s progress file is."""
        return directory / f"rank-{rank}.progress"

    def write(self, record: str) -> None:
        """Rewrite the file with one JSON text (cut to the file's size: then unreadable, as if absent)."""
        text = record.encode()[: BEACON_BYTES - 1] + b"\n"
        self._map[: len(text)] = text

    @classmethod
    def open_entries(cls, directory: Path, rank: int) -> list[LedgerEntry]:
        """The collectives rank ``rank`` had entered and not finished when it last wrote its file."""
        beacon = cls.read(directory, rank)
        return [] if beacon is None else _open_entries(beacon)

    @classmethod
    def read(cls, directory: Path, rank: int) -> dict[str, Any] | None:
        """The rank's last record, or None when it wrote none (or none whole)."""
        for _ in range(3):  # a running peer may be rewriting it: read again
            try:
                text = cls.path_of(directory, rank).read_bytes().split(b"\n", 1)[0].strip()
                return json.loads(text) if text else None
            except OSError:
                return None
            except ValueError:
                time.sleep(0.01)
        return None


class _At:
    """:meth:`CollectiveLedger.at`'s block: a plain class, since every layer call enters one (a
    generator-based context manager cost 16 µs of a one-token forward with a cold cache)."""

    __slots__ = ("before", "location", "where")

    def __init__(self, location: Location, where: dict[str, Any]) -> None:
        self.location, self.where, self.before = location, where, {}

    def __enter__(self) -> None:
        location = self.location
        self.before = {name: getattr(location, name) for name in self.where}
        for name, value in self.where.items():
            setattr(location, name, value)

    def __exit__(self, *exc: object) -> None:
        for name, value in self.before.items():
            setattr(self.location, name, value)
