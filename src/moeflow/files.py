"""Files and lines that others read: atomic writes (a reader, or a crash, sees the old file or the
new one, never half of one) and strict JSON (no NaN or Infinity, which JSON does not have)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def write_atomic(path: Path, payload: bytes | str) -> None:
    """Write to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(payload.encode() if isinstance(payload, str) else payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float (a NaN loss, an infinite norm) replaced by None, in
    nested dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def json_text(value: Any, **options: Any) -> str:
    """Strict JSON: a non-finite float becomes null, never the ``NaN`` a strict parser refuses."""
    return json.dumps(finite_or_null(value), allow_nan=False, **options)


def print_json(obj: dict[str, Any]) -> None:
    """One JSON line on stdout (a benchmark's measurement, a plan): floats keep 4 significant
    digits, so tiny fitted slopes stay visible."""
    print(json_text({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in obj.items()}), flush=True)
