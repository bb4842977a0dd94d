"""Where experts live (:class:`ExpertPlacement`) and how an expert block runs over ranks
(:class:`ParallelSchedule`). The names load on first use, so that the registry of techniques
(:mod:`moeflow.parallel.registry`), which the simulator reads, imports no torch."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = dict.fromkeys(("ExpertPlacement", "ExpertShard", "expert_kind"), "placement")


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'moeflow.parallel' has no attribute {name!r}")
    return getattr(import_module(f"moeflow.parallel.{_HOMES[name]}"), name)


__all__ = ["ExpertPlacement", "ExpertShard", "expert_kind"]
