"""Process-level settings for fast CPU execution, applied by moeflow's entry points (CLI, workers).

glibc returns large freed blocks to the OS (``mmap``/trim) and the next allocation of the same size
page-faults it back in: an MoE step allocates many multi-MB tensors, and on the 2-core machines
this cost a third of the benchmark's wall time in system time. Keeping freed memory in the heap
removes that. Importing moeflow never changes process state; entry points call
:func:`tune_cpu_allocator`, and ``MOEFLOW_MALLOC_TUNING=0`` turns it off. The layer no longer
depends on it: its workspace reuses the large buffers itself (:mod:`moeflow.core.workspace`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Mapping

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_tuned: bool | None = None


def tuning_requested(environment: Mapping[str, str]) -> bool:
    """What the entry points ask for: on unless ``MOEFLOW_MALLOC_TUNING=0``."""
    return environment.get("MOEFLOW_MALLOC_TUNING", "1") != "0"


def tune_cpu_allocator(enabled: bool = True) -> bool:
    """Keep freed memory for reuse (glibc only), once per process. Returns whether the setting is
    in effect. The process-wide malloc settings are the one state this module keeps."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not enabled or not sys.platform.startswith("linux"):
        return _tuned
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return _tuned
    _tuned = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _tuned


def give_back_free_memory() -> None:
    """Return the heap's free pages to the OS (glibc's ``malloc_trim``) where :func:`tune_cpu_allocator`
    keeps freed memory: called between phases whose buffers differ (before an evaluation), so that
    the next phase reuses those pages instead of growing the heap around the last phase's holes.
    Without the tuning, glibc already returns large blocks itself: nothing to do."""
    if _tuned:
        _libc().malloc_trim(0)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
