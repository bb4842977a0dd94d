"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, payload: bytes | str) -> None:
    """Write to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(payload.encode() if isinstance(payload, str) else payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
