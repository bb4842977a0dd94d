"""A layer's reusable buffers, so that a plain script is as fast as a tuned allocator.

glibc hands multi-MB blocks back to the kernel when they are freed, and the next allocation of
the same size page-faults every page in again: in an MoE step that was a quarter of the time,
spent as system time. Rather than changing malloc for the whole process, each layer keeps the
large intermediates of its expert computation (activations, their gradients, the expert outputs)
and hands them out again on the next step.

Lifetimes are explicit: the code that takes a buffer gives it back when nothing reads it any more
(the backward, after the weight gradients; the pipeline, after a chunk's output is sent on). A
buffer that is never given back (a graph dropped without a backward) is simply freed by Python,
and the next step allocates anew. Buffers of shapes not used in the previous step are dropped, so
a change of capacity frees the old ones.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class Workspace:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # chunk outputs come back from the communication thread
        self._free: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        self._used_this_step: set[_Key] = set()

    def __deepcopy__(self, memo: dict[int, object]) -> Workspace:
        return Workspace()  # a copied layer keeps its own buffers, starting empty

    def take(self, shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized buffer of ``shape`` with ``like``'s dtype and device."""
        key = (tuple(shape), like.dtype, like.device)
        with self._lock:
            self._used_this_step.add(key)
            free = self._free.get(key)
            if free:
                return free.pop()
        return torch.empty(key[0], dtype=like.dtype, device=like.device)

    def give(self, *tensors: torch.Tensor | None) -> None:
        """Return buffers (from :meth:`take`) that nothing reads any more."""
        with self._lock:
            for tensor in tensors:
                if tensor is not None:
                    self._free[(tuple(tensor.shape), tensor.dtype, tensor.device)].append(tensor)

    def start_step(self) -> None:
        """Drop the free buffers of shapes the previous step did not use."""
        with self._lock:
            for key in [k for k in self._free if k not in self._used_this_step]:
                del self._free[key]
            self._used_this_step = set()

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)
