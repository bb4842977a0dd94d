"""A layer's reusable buffers, so that a plain script is as fast as a tuned allocator.

glibc hands multi-MB blocks back to the kernel when they are freed, and the next allocation of
the same size page-faults every page in again: in an MoE step that was a quarter of the time,
spent as system time. Rather than changing malloc for the whole process, each layer keeps the
storage of its large tensors (the dispatched tokens, the experts' activations and outputs, their
gradients, the expert weight gradients) and hands it out again.

A buffer is handed out again only when the workspace holds the last reference to its storage: no
tensor anywhere (a saved activation, a ``.grad`` the user kept, a view) still uses it. So no code
has to say when it is done with a buffer, a graph dropped without a backward frees nothing twice,
and a gradient that autograd hands to the user is never written over while they hold it. The
workspace keeps, per shape, as many buffers as the last step had in use at once; shapes that the
last step did not take are dropped, and a shape never seen before (a new capacity or pipeline
degree) drops at once the free buffers of the shapes this step has not taken, so that a change of
plan never holds two plans' buffers.

The layers of one model share one workspace (:func:`share_workspace`; moeflow's models and the
Hugging Face loader do it): a layer's backward buffers are free again once its backward ends, so
the next layer's backward takes the same ones, and L layers hold one set of transient buffers,
not L. A step begins when a layer that already started in the current step starts again.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

import torch

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class Workspace:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # chunks are dispatched and combined on the communication thread
        self._held: dict[_Key, list[torch.UntypedStorage]] = defaultdict(list)
        self._peak_in_use: dict[_Key, int] = defaultdict(int)  # most buffers in use at once this step
        self._started: set[int] = set()  # the layers that started in this step

    def __deepcopy__(self, memo: dict[int, object]) -> Workspace:
        return Workspace()  # a copied layer keeps its own buffers, starting empty

    def take(self, shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized contiguous buffer of ``shape`` with ``like``'s dtype and device."""
        key = (tuple(shape), like.dtype, like.device)
        with self._lock:
            if key not in self._held:
                self._drop_free(keep=self._peak_in_use.keys())  # new shapes (another plan): the old ones go
            held = self._held[key]
            free = [storage for storage in held if _only_reference(storage)]
            self._peak_in_use[key] = max(self._peak_in_use[key], len(held) - len(free) + 1)
            if free:
                return like.new_empty(0).set_(free[0], 0, key[0])
            fresh = torch.empty(key[0], dtype=like.dtype, device=like.device)
            held.append(fresh.untyped_storage())
            return fresh

    def start_step(self, owner: int | None = None) -> None:
        """A layer's forward begins (``owner``: its id; None: a new step in any case). When the
        step that ends is over, keep per shape at most as many buffers as it had in use at once,
        free ones first."""
        with self._lock:
            if owner is not None and owner not in self._started:
                self._started.add(owner)
                return
            for key, held in list(self._held.items()):
                held.sort(key=lambda storage: not _only_reference(storage))
                del held[self._peak_in_use.get(key, 0):]
                if not held:
                    del self._held[key]
            self._peak_in_use = defaultdict(int)
            self._started = set() if owner is None else {owner}

    def release(self) -> None:
        """Drop every buffer no tensor uses (before a no-grad forward, whose buffers are of
        other shapes: held, they would add to its peak)."""
        if not self._held:  # nothing to look at (every no-grad forward asks)
            return
        with self._lock:
            self._drop_free(keep=())

    def _drop_free(self, keep: Iterable[_Key]) -> None:
        kept = set(keep)
        for key, held in list(self._held.items()):
            if key not in kept:
                held[:] = [storage for storage in held if not _only_reference(storage)]
                if not held:
                    del self._held[key]

    @property
    def pooled_bytes(self) -> int:
        """Bytes held that no tensor uses now: what the next step reuses instead of allocating."""
        with self._lock:
            return sum(s.nbytes() for held in self._held.values() for s in held if _only_reference(s))


def buffer(workspace: Workspace | None, shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
    """A buffer from ``workspace``, or a new tensor where there is none."""
    return like.new_empty(shape) if workspace is None else workspace.take(shape, like)


def _only_reference(storage: torch.UntypedStorage) -> bool:
    """Whether the workspace holds the last reference to ``storage``."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


class _HasWorkspace(Protocol):
    workspace: Workspace


def share_workspace(layers: Iterable[_HasWorkspace]) -> Workspace:
    """Give ``layers`` (the MoE layers of one model) one workspace, so that they hold one set of
    transient backward buffers between them instead of one each; returns it."""
    shared = Workspace()
    for layer in layers:
        layer.workspace = shared
    return shared
