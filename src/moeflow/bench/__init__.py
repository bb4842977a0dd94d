"""Benchmarks: each prints one JSON object per measurement and a summary line."""

from __future__ import annotations

import io
import json
from typing import Any


def print_json(obj: dict[str, Any]) -> None:
    """One JSON line; floats keep 4 significant digits (so tiny fitted slopes stay visible)."""
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in obj.items()}), flush=True)


class RankZeroRecords(io.StringIO):
    """A sink for :func:`moeflow.testbed.launch`: keeps all output, and collects and prints rank
    0's JSON lines (with ``extra`` fields merged in) as they arrive."""

    def __init__(self, **extra: Any) -> None:
        super().__init__()
        self.extra = extra
        self.records: list[dict[str, Any]] = []
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if line.startswith("[rank 0] {"):
                record = {**json.loads(line.removeprefix("[rank 0] ")), **self.extra}
                self.records.append(record)
                print(json.dumps(record), flush=True)
        return super().write(text)
