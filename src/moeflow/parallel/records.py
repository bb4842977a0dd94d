"""The two kinds of technique record, and the records other packages install.

A package adds a technique to moeflow without touching moeflow: it declares one record (a
:class:`ScheduleSpec` or a :class:`FeatureSpec`) and names it under the ``moeflow.techniques``
entry point group of its metadata, e.g. in its ``pyproject.toml``::

    [project.entry-points."moeflow.techniques"]
    mine = "mypackage.mine:MINE"

The registry (:mod:`moeflow.parallel.registry`) reads them once, beside its own, and everything
that lists techniques (the ``parallel`` choices, ``parallel='auto'``, the simulator, ``moeflow plan
--cluster``, the combination check) then sees them. This module imports no torch: a record's
``make`` imports its run class when it is called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from moeflow.config import PADDED, MoEConfig
from moeflow.perf.sim.technique import SimulatedSchedule

if TYPE_CHECKING:
    from moeflow.parallel.schedules import ParallelSchedule

ENTRY_POINT_GROUP = "moeflow.techniques"
"""The entry point group under which installed packages name their technique records."""


@dataclass(frozen=True)
class ShardingLayout:
    """What every schedule's factory is given: the tensor-parallel attention's group size (N_MP)
    and the hidden shards of each expert (N_ESP) for the schedules that run behind it (Parm's;
    the others ignore both), and how the expert-parallel schedule's tokens travel (the others send
    padded chunks). Parm's Table III varies N_MP and N_ESP independently; N_ESP defaults to N_MP,
    its real models' setting, where an MP group is also an ESP group."""

    mp_size: int = 1
    esp_size: int | None = None  # None: N_MP (moeflow.perf.parm.shard_count)
    token_exchange: str = PADDED  # padded, ragged or auto (moeflow.config.TOKEN_EXCHANGE_CHOICES)
    dedup_candidate: bool = False  # under auto, the planner may also price dedup (its record allows it here)


@dataclass(frozen=True)
class ScheduleSpec:
    """A technique the layer's ``parallel`` setting names. ``make`` imports its run class when
    called, so the records (and the simulator and planner, which read them) load without torch."""

    name: str
    paper: str
    make: Callable[[ShardingLayout], ParallelSchedule]  # its run class, behind the layout's tensor-parallel group
    simulated: SimulatedSchedule  # its expert region, checks and plan space in the simulator (moeflow.sim)
    takes_ragged: bool = False  # run() uses the ragged kernel where the layer asks for it
    behind_model_parallel: bool = False  # runs behind tensor-parallel attention (needs an mp_group)
    ranked_by_auto: bool = False  # parallel='auto' ranks it with the cost model
    replicates_experts: bool = False  # every expert on every rank: the experts need not divide over the ranks
    takes_r: bool = False  # runs at Tutel's r (an int ``parallel`` is this schedule at that r)


@dataclass(frozen=True)
class FeatureSpec:
    """A technique turned on beside the schedule. ``enabled`` reads it from a layer's config;
    None for one a function applies to a built layer (packing, inference scheduling)."""

    name: str  # how messages name it: the setting, e.g. "shadowing"
    paper: str
    does: str  # what it does, completing "<name> ..."
    off: str  # the setting that turns it off
    runs_on: tuple[str, ...]  # the schedules it works with (their run class's name)
    enabled: Callable[[MoEConfig], bool] | None = None
    excludes: tuple[str, ...] = ()  # features it cannot run beside (either side may declare it)
    simulated: SimulatedSchedule | None = None  # a simulator mode of its own ...
    simulated_as: str = ""  # ... under this name


@dataclass(frozen=True)
class SimulatedSpec:
    """What the simulator reads of a record (a schedule's, or a feature's with a mode of its own)."""

    simulated: SimulatedSchedule
    behind_model_parallel: bool = False
    replicates_experts: bool = False
    takes_r: bool = False


def installed_records() -> tuple[ScheduleSpec | FeatureSpec, ...]:
    """The records installed packages name under :data:`ENTRY_POINT_GROUP` (by entry point name),
    each checked to be a record."""
    records: list[ScheduleSpec | FeatureSpec] = []
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name):
        record = point.load()
        if not isinstance(record, ScheduleSpec | FeatureSpec):
            raise TypeError(f"the {ENTRY_POINT_GROUP} entry point {point.name!r} ({point.value}) names a "
                            f"{type(record).__name__}, not a ScheduleSpec or FeatureSpec: point it at the record")
        records.append(record)
    return tuple(records)


def check_unique_names(records: Sequence[ScheduleSpec | FeatureSpec]) -> None:
    """No two techniques share a name (an installed one may not take a built-in one's)."""
    seen: set[str] = set()
    for record in records:
        if record.name in seen:
            raise ValueError(f"two techniques are named {record.name!r}: rename the installed one "
                             f"(its {ENTRY_POINT_GROUP} entry point's record)")
        seen.add(record.name)
