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
last step did not take are dropped, so a change of capacity frees the old ones.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class Workspace:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # chunks are dispatched and combined on the communication thread
        self._held: dict[_Key, list[torch.UntypedStorage]] = defaultdict(list)
        self._taken: dict[_Key, int] = defaultdict(int)  # buffers handed out since start_step

    def __deepcopy__(self, memo: dict[int, object]) -> Workspace:
        return Workspace()  # a copied layer keeps its own buffers, starting empty

    def take(self, shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized contiguous buffer of ``shape`` with ``like``'s dtype and device."""
        key = (tuple(shape), like.dtype, like.device)
        with self._lock:
            self._taken[key] += 1
            for storage in self._held[key]:
                if _only_reference(storage):
                    return like.new_empty(0).set_(storage, 0, key[0])
            fresh = torch.empty(key[0], dtype=like.dtype, device=like.device)
            self._held[key].append(fresh.untyped_storage())
            return fresh

    def start_step(self) -> None:
        """Keep per shape at most as many buffers as the step that ends took (free ones first)."""
        with self._lock:
            for key, held in list(self._held.items()):
                held.sort(key=lambda storage: not _only_reference(storage))
                del held[self._taken.get(key, 0):]
                if not held:
                    del self._held[key]
            self._taken = defaultdict(int)

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
