"""Where a step's figures go: a JSONL file (one record per step), a CSV a spreadsheet opens, or
TensorBoard (scalars, and each layer's load per expert as a histogram). A sink is given by setting;
TensorBoard's writer is imported only when that sink is made (the ``tensorboard`` extra)."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from moeflow.files import json_text


class MetricsSink(Protocol):
    """Writes one step: its flat scalars, each layer's load per expert and the full JSON record."""

    def write(self, step: int, scalars: Mapping[str, float], loads: Mapping[str, Sequence[int]],
              record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON record per line (appended; flushed each step, so a crashed run keeps its steps).
    ``keep_through``: a resumed run's step; the file's records after it are dropped first."""

    def __init__(self, path: str | Path, keep_through: int | None = None) -> None:
        self.path = Path(path)
        if keep_through is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line)["step"] <= keep_through]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._handle = open(self.path, "a")  # noqa: SIM115 - open for the run, closed by close()

    def write(self, step: int, scalars: Mapping[str, float], loads: Mapping[str, Sequence[int]],
              record: Mapping[str, Any]) -> None:
        self.write_record(record)

    def write_record(self, record: Mapping[str, Any]) -> None:
        """One record, as its line."""
        self._handle.write(json_text(dict(record)) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class CsvSink:
    """A row per step, a column per scalar: ``columns`` first, then the first step's others (later
    new names are left out, a missing value left empty), so the file stays rectangular.
    ``keep_through``: a resumed run's step; the file's rows up to it stay, under their header."""

    def __init__(self, path: str | Path, keep_through: int | None = None, columns: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.columns = list(columns)
        self._writer: csv.DictWriter[str] | None = None
        kept: list[dict[str, str]] = []
        if keep_through is not None and self.path.exists():
            with open(self.path, newline="") as existing:
                reader = csv.DictReader(existing)
                kept = [row for row in reader if int(row["step"]) <= keep_through]
                columns = list(reader.fieldnames or [])
        self._handle = open(self.path, "w", newline="")  # noqa: SIM115 - open for the run, closed by close()
        if kept:
            self._writer = csv.DictWriter(self._handle, fieldnames=columns, extrasaction="ignore")
            self._writer.writeheader()
            self._writer.writerows(kept)

    def write(self, step: int, scalars: Mapping[str, float], loads: Mapping[str, Sequence[int]],
              record: Mapping[str, Any]) -> None:
        if self._writer is None:
            names = ["step", *self.columns, *(name for name in scalars if name not in self.columns)]
            self._writer = csv.DictWriter(self._handle, fieldnames=names, extrasaction="ignore")
            self._writer.writeheader()
        self._writer.writerow({"step": step, **scalars})
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class TensorBoardSink:
    """TensorBoard's event files under ``log_dir``: every scalar, and each layer's load as a
    histogram over the expert ids (bucket e holds expert e's assignments)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("the TensorBoard sink needs the tensorboard package: pip install 'moeflow[tensorboard]' "
                              "(make setup installs it)") from error
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir))

    def write(self, step: int, scalars: Mapping[str, float], loads: Mapping[str, Sequence[int]],
              record: Mapping[str, Any]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        for tag, counts in loads.items():
            self._writer.add_histogram_raw(tag, **expert_histogram(counts), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def expert_histogram(counts: Sequence[int]) -> dict[str, Any]:
    """A load per expert as TensorBoard's raw histogram: one bucket per expert id (right edges at
    e + 0.5), ``counts[e]`` values of e in it."""
    total = sum(counts)
    return {"min": 0.0, "max": float(len(counts) - 1), "num": total,
            "sum": float(sum(expert * count for expert, count in enumerate(counts))),
            "sum_squares": float(sum(expert * expert * count for expert, count in enumerate(counts))),
            "bucket_limits": [expert + 0.5 for expert in range(len(counts))], "bucket_counts": list(counts)}
