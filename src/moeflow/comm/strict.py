"""Strict collectives: what NCCL requires, checked on any backend (gloo included).

NCCL makes progress only when every rank of a communicator enqueues the same collectives in the
same order, every group is made by every rank of the world in one order (``ncclCommSplit``), and
every tensor lives on the device of the group's backend. gloo forgives much of this: two
all-reduces swapped on one rank, a collective skipped where a later one of the same size stands in,
a group made lazily by its own ranks alone all pass there and hang (or sum the wrong numbers) on
NCCL. :class:`StrictCollectives` records, while it is active, every collective this process issues
through ``torch.distributed``'s Python functions (moeflow's own, through :mod:`moeflow.comm`, and
FSDP2's and DeviceMesh's where they call them; DTensor's functional collectives, operators of
their own, pass unseen), and at the end of the job compares each group's sequence across its ranks
(:meth:`StrictCollectives.verify`): the first divergence fails the job on every rank, naming it.

It refuses at once a collective whose tensor is not on a device the group's backend serves (a CPU
tensor into an NCCL group), and it records every group made (``new_group``, ``split_group``) in the
world's sequence, so a group made by some ranks only is a divergence too.

A debug mode, off by default (as ``torch.autograd.detect_anomaly``): while active it wraps
``torch.distributed``'s collective functions for the whole process. The test suite runs every
distributed job with it (:func:`moeflow.distributed.run_in_group` with ``strict=True``).
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.collectives import backend_devices

Entry = tuple[str, str, int]
"""One recorded collective: (operation, dtype, element count); "" and -1 where ranks may differ."""


class CollectiveOrderError(RuntimeError):
    """Ranks of one group issued different collectives (or one issued none), or a tensor is not on
    a device its group's backend serves: what hangs or sums the wrong values on NCCL."""


@dataclass(frozen=True)
class Spec:
    """How to read one ``torch.distributed`` function's call: the argument holding the tensor (or
    list of tensors) whose count every rank must agree on, and whether it must (all-to-alls and
    object collectives carry sizes that differ by rank)."""

    tensor: str | None
    counts_match: bool = True


COLLECTIVES: dict[str, Spec] = {
    "all_reduce": Spec("tensor"),
    "all_reduce_coalesced": Spec("tensors"),
    "broadcast": Spec("tensor"),
    "reduce": Spec("tensor"),
    "all_gather": Spec("tensor"),
    "all_gather_single": Spec("input_tensor"),
    "all_gather_into_tensor": Spec("input_tensor"),
    "all_gather_coalesced": Spec("input_tensor_list"),
    "reduce_scatter": Spec("output"),
    "reduce_scatter_single": Spec("output"),
    "reduce_scatter_tensor": Spec("output"),
    "all_to_all_single": Spec("input", counts_match=False),
    "all_to_all": Spec("input_tensor_list", counts_match=False),
    "gather": Spec("tensor"),
    "scatter": Spec("tensor"),
    "barrier": Spec(None),
    "monitored_barrier": Spec(None),
    "all_gather_object": Spec(None, counts_match=False),
    "broadcast_object_list": Spec(None, counts_match=False),
    "gather_object": Spec(None, counts_match=False),
    "scatter_object_list": Spec(None, counts_match=False),
}
"""The group collectives recorded, by ``torch.distributed`` name."""
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
"""Recorded per pair of ranks: each pair's sends and receives must match in order."""
GROUP_MAKERS = ("new_group", "split_group")
"""Recorded in the world's sequence: every rank makes every group, in one order."""
PATCHED_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.device_mesh")
"""Where the functions are looked up (DeviceMesh imports ``new_group`` by name)."""
STORE_PREFIX = "moeflow/strict/"
FAILED_WAIT_S = 0.5
"""How long a rank of a job that failed waits for its peers' records (a peer may have died): short,
so the job's own error (which names the phase) reaches the launcher before it notices a dead peer."""


class StrictCollectives:
    """Records this rank's collectives while active (``with StrictCollectives(rank, world):``), then
    compares them with every rank's over the job's store (:meth:`verify`)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.sequences: dict[str, list[Entry]] = {}
        """Each group's (and each pair's) collectives in the order this rank issued them."""
        self.members: dict[str, list[int]] = {}
        """Each sequence's ranks (global), which must all hold it."""
        self._lock = threading.Lock()
        self._inside = threading.local()  # a collective issued inside a recorded one is its own
        self._saved: list[tuple[ModuleType, str, Callable[..., Any]]] = []
        self._names: dict[int, tuple[str, list[int]]] = {}

    def __enter__(self) -> StrictCollectives:
        import importlib

        wrappers: dict[int, Callable[..., Any]] = {}  # one per function: P2POp compares isend by identity
        for module_name in PATCHED_MODULES:
            module = importlib.import_module(module_name)
            for name in (*COLLECTIVES, *POINT_TO_POINT, *GROUP_MAKERS, "batch_isend_irecv"):
                original = getattr(module, name, None)
                if callable(original):
                    self._saved.append((module, name, original))
                    wrapper = wrappers.setdefault(id(original), self._wrapped(name, original))
                    setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrapped(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0):
                return original(*args, **kwargs)
            arguments = signature.bind(*args, **kwargs).arguments
            self._record(name, arguments)
            self._inside.depth = 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth = 0

        call.__wrapped__ = original  # type: ignore[attr-defined]
        call.__name__ = original.__name__  # P2POp's repr and checks read it
        return call

    def _record(self, name: str, arguments: dict[str, Any]) -> None:
        if name in GROUP_MAKERS:  # new_group: every rank of the world; split_group: every rank of the parent
            ranks = arguments.get("ranks", arguments.get("split_ranks"))
            local = bool(arguments.get("use_local_synchronization", False))
            parent = arguments.get("parent_pg") or _world()
            self._append(parent, (f"{name}({_ranks_text(ranks)}{', local' if local else ''})", "", -1))
        elif name == "batch_isend_irecv":  # one entry per pair and batch: a batch's order is free
            batch: dict[str, tuple[list[int], list[str]]] = {}
            for op in arguments["p2p_op_list"]:
                key, pair, entry = self._point_to_point(op.group, op.peer, op.op.__name__ in ("isend", "send"),
                                                        op.tensor)
                batch.setdefault(key, (pair, []))[1].append(_entry_text(entry))
            for key, (pair, texts) in batch.items():
                self._append_to(key, pair, (f"batch [{'; '.join(sorted(texts))}]", "", -1))
        elif name in POINT_TO_POINT:
            group = arguments.get("group")
            peer = arguments.get("dst" if name in ("send", "isend") else "src")
            if peer is None:
                local_peer = arguments.get("group_dst" if name in ("send", "isend") else "group_src")
                if local_peer is None:  # a receive from any rank: no pair to hold it against
                    return
                peer = dist.get_global_rank(group or _world(), local_peer)
            self._append_to(*self._point_to_point(group, peer, name in ("send", "isend"), arguments["tensor"]))
        else:
            self._collective(name, arguments)

    def _collective(self, name: str, arguments: dict[str, Any]) -> None:
        spec = COLLECTIVES[name]
        group = arguments.get("group") or _world()
        tensors = _tensors(arguments.get(spec.tensor)) if spec.tensor else []
        for value in arguments.values():  # inputs and outputs alike
            for tensor in _tensors(value) + [t for item in _lists(value) for t in _tensors(item)]:
                self._check_device(name, group, tensor)
        if not tensors:
            self._append(group, (name, "", -1))
            return
        count = sum(tensor.numel() for tensor in tensors) if spec.counts_match else -1
        self._append(group, (name, str(tensors[0].dtype).removeprefix("torch."), count))

    def _point_to_point(
        self, group: dist.ProcessGroup | None, peer: int, sending: bool, tensor: torch.Tensor
    ) -> tuple[str, list[int], Entry]:
        """The pair's sequence (named by its two global ranks on the group), the pair, and the
        entry of one message."""
        group = group or _world()
        self._check_device("send" if sending else "receive", group, tensor)
        source, dest = (self.rank, peer) if sending else (peer, self.rank)
        pair = sorted({source, dest})
        name, _ = self._name(group)
        key = f"{name}: point-to-point {pair[0]}<->{pair[-1]}"
        return key, pair, (f"{source}->{dest}", str(tensor.dtype).removeprefix("torch."), tensor.numel())

    def _append(self, group: dist.ProcessGroup, entry: Entry) -> None:
        self._append_to(*self._name(group), entry)

    def _append_to(self, key: str, ranks: list[int], entry: Entry) -> None:
        """``entry`` at the end of sequence ``key``, which ranks ``ranks`` must all hold."""
        with self._lock:
            self.members[key] = ranks
            self.sequences.setdefault(key, []).append(entry)

    def _name(self, group: dist.ProcessGroup) -> tuple[str, list[int]]:
        key = id(group)
        if key not in self._names:
            ranks = dist.get_process_group_ranks(group)
            self._names[key] = (f"group {group.group_name} ({_ranks_text(ranks)})", ranks)
        return self._names[key]

    def _check_device(self, operation: str, group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
        backend = str(dist.get_backend(group))
        served = backend_devices(backend)
        if tensor.device.type not in served:
            name, _ = self._name(group)
            raise CollectiveOrderError(
                f"worker {self.rank}: {operation} of a {tensor.device.type} tensor on {name}, whose backend "
                f"{backend!r} serves {', '.join(sorted(served))} only: put host values on "
                "moeflow.comm.collectives.host_device(group), device values on the group's device"
            )

    def verify(self, store: dist.Store, timeout_s: float = 30.0, failed: bool = False) -> None:
        """Publish this rank's sequences on ``store`` and compare them with every rank's; raise
        :class:`CollectiveOrderError` naming the first divergence (the same on every rank). A
        ``failed`` job waits for its peers' records a short while only (a peer may be gone)."""
        with self._lock:
            record = json.dumps({"sequences": self.sequences, "members": self.members, "failed": failed})
        # a job that ended well waits for a peer that is still timing out in a collective this one skipped;
        # a failed job's peers may be gone
        wait_s = min(timeout_s, FAILED_WAIT_S) if failed else 2 * timeout_s
        store.set(f"{STORE_PREFIX}{self.rank}", record)
        records = _peer_records(store, self.world_size, wait_s)
        store.add(f"{STORE_PREFIX}read", 1)
        if self.rank == 0:  # the store's server lives in this process: wait until every peer has read
            _wait_for_count(store, f"{STORE_PREFIX}read", len(records), wait_s)
        problem = first_divergence(records, complete=not failed)
        if problem is not None:
            raise CollectiveOrderError(problem)


def first_divergence(records: dict[int, dict[str, Any]], complete: bool = True) -> str | None:
    """The first place where two ranks of a group (or a pair) issued different collectives, in
    words; None when every group's ranks agree. ``records``: each rank's published sequences; a
    rank that published none is left out, and named when the records should be ``complete`` (a
    job that ended well; after a failure a peer may be gone, which its own error says)."""
    members: dict[str, list[int]] = {}
    for record in records.values():
        members.update(record["members"])
    for key in sorted(members):
        ranks = [rank for rank in members[key] if rank in records]
        missing = [rank for rank in members[key] if rank not in records]
        sequences = {rank: [tuple(e) for e in records[rank]["sequences"].get(key, [])] for rank in ranks}
        failed = {rank for rank in ranks if records[rank].get("failed")}
        for rank in ranks[1:]:
            problem = _compare(key, ranks[0], sequences[ranks[0]], rank, sequences[rank], failed)
            if problem is not None:
                return problem
        if complete and missing and any(sequences.values()):
            return f"on {key}: worker(s) {missing} left no record of their collectives (failed or gone)"
    return None


def _compare(
    key: str, first: int, mine: list[Entry], other: int, theirs: list[Entry], failed: Collection[int] = ()
) -> str | None:
    """The first entry where two ranks' sequences of ``key`` differ; a rank whose job ``failed``
    stopped early, which is no divergence (its own error says why)."""
    for index in range(max(len(mine), len(theirs))):
        a = mine[index] if index < len(mine) else None
        b = theirs[index] if index < len(theirs) else None
        if (a is None and first in failed) or (b is None and other in failed):
            return None
        if a != b:
            return (f"collective order differs on {key} at its collective #{index + 1}: worker {first} issued "
                    f"{_entry_text(a)} while worker {other} issued {_entry_text(b)}; every rank of a group must "
                    "issue the same collectives in the same order (NCCL hangs or mixes them up otherwise)")
    return None


def _entry_text(entry: Entry | None) -> str:
    if entry is None:
        return "nothing"
    operation, dtype, count = entry
    if not dtype:
        return operation
    return f"{operation} of {dtype}" + (f" x {count}" if count >= 0 else "")


def _peer_records(store: dist.Store, world_size: int, timeout_s: float) -> dict[int, dict[str, Any]]:
    """Every rank's published record that arrives within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        key = f"{STORE_PREFIX}{rank}"
        while True:
            if store.check([key]):
                records[rank] = json.loads(store.get(key))
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
    return records


def _wait_for_count(store: dist.Store, key: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(0.01)


@contextmanager
def strict_collectives(
    rank: int, world_size: int, store: dist.Store, timeout_s: float = 30.0
) -> Iterator[StrictCollectives]:
    """Record the block's collectives and verify them across ranks at its end (also when it
    raises: the divergence, if any, is then added to the error as a note)."""
    strict = StrictCollectives(rank, world_size)
    try:
        with strict:
            yield strict
    except BaseException as error:
        order = _divergence_after_failure(strict, store, timeout_s)
        if order is not None:  # the job's own error stays what it is; the divergence is its note
            error.add_note(f"strict collectives: {order}")
        raise
    strict.verify(store, timeout_s)


def _divergence_after_failure(strict: StrictCollectives, store: dist.Store, timeout_s: float) -> str | None:
    """The divergence, if any, behind a job that failed, found within a few seconds: on a thread
    of its own, because the store's server lives in rank 0, which may be stopped or dead (a call to
    it would then wait out the store's timeout); None when it cannot tell in time."""
    found: list[str | None] = [None]

    def compare() -> None:
        try:
            strict.verify(store, timeout_s, failed=True)
        except CollectiveOrderError as order:
            found[0] = str(order)
        except Exception:  # a broken store must not hide the job's own error
            pass

    thread = threading.Thread(target=compare, name="moeflow-strict-check", daemon=True)
    thread.start()
    thread.join(timeout=2 * FAILED_WAIT_S + 1.0)
    return found[0]


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "torch.distributed is not initialized"
    return group


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


def _lists(value: Any) -> list[Any]:
    """The lists inside a list argument (all_gather_coalesced's list of output lists)."""
    return [item for item in value if isinstance(item, list)] if isinstance(value, list) else []


def _ranks_text(ranks: Any) -> str:
    return "all ranks" if ranks is None else f"ranks {','.join(map(str, ranks))}"

