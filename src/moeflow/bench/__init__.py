"""Benchmarks: each prints one JSON object per measurement and a summary line."""

from __future__ import annotations

import json
from typing import Any


def print_json(obj: dict[str, Any]) -> None:
    """One JSON line; floats keep 4 significant digits (so tiny fitted slopes stay visible)."""
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in obj.items()}), flush=True)
