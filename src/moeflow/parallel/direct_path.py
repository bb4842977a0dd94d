"""How a schedule lets a call skip the capacity buffer on a rank: its declaration, typed.

A schedule declares it once per placement and rank (``ParallelSchedule.direct_path``); the layer's
dispatchers (:mod:`moeflow.parallel.dispatchers.choice`) turn it into the dispatcher a call runs.
"""

from __future__ import annotations

import enum


class DirectPath(enum.Enum):
    """``LOCAL``: every expert is whole on this rank, so a call's tokens may stay home (the local
    dispatcher). ``EXCHANGE``: each expert has one holder, so a small call's tokens may go straight
    to it (gathered with the load agreement, or as rows in one ragged all-to-all each way)."""

    LOCAL = "local"
    EXCHANGE = "exchange"
