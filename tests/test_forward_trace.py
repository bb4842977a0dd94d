"""One default training forward of one layer, traced (``scripts/trace_forward.py``): how many
moeflow modules it runs through and how often it crosses between the layer's package and the
techniques'. The layer enters the techniques' package twice: to make the call's record, and from the
load agreement through the statistics (dispatch, experts, combine in one stretch). The module ceiling
is today's figure, so a change that adds a module to the forward fails here; issue 78's target was
12. Issue 80 added one: the expert kernel each call runs (``moeflow.perf.kernel_rates``)."""

from __future__ import annotations

import runpy
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "trace_forward.py"
MODULES_CEILING = 37
CROSSINGS_CEILING = 4


def test_the_default_forward_stays_within_its_modules_and_crossings() -> None:
    script = runpy.run_path(str(SCRIPT))
    sequence = script["traced_forward"]()
    record = script["summary"](sequence)
    assert sequence[0] == "moeflow.moe.layer" and "moeflow.parallel.chunk_pipeline" in sequence
    assert record["modules"] <= MODULES_CEILING, sorted(set(sequence))
    assert record["crossings"] <= CROSSINGS_CEILING, sequence


def test_the_summary_counts_crossings_between_the_two_packages_only() -> None:
    summary = runpy.run_path(str(SCRIPT))["summary"]
    sequence = ["moeflow.moe.layer", "moeflow.core.stats", "moeflow.parallel.schedules", "moeflow.comm.groups",
                "moeflow.parallel.context", "moeflow.moe.layer"]
    assert summary(sequence) == {"modules": 5, "changes": 5, "hops": 0, "crossings": 2}
