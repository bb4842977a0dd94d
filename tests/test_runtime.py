"""Process-level settings: allocator tuning by entry points, process-group resolution."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moeflow.comm.groups import ParallelGroups, default_group, group_rank, group_size

PROBE = (  # what an entry point does
    "import os; from moeflow.runtime import tune_cpu_allocator as t, tuning_requested as r; "
    "print(t(r(os.environ)), t(r(os.environ)))"
)


def _probe(env_value: str | None) -> str:
    env = {"PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:  # moeflow run from a source tree rather than installed
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if env_value is not None:
        env["MOEFLOW_MALLOC_TUNING"] = env_value
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True, env=env
    ).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_allocator_tuning_is_on_by_default_and_idempotent() -> None:
    assert _probe(None) == "True True"


def test_allocator_tuning_can_be_turned_off() -> None:
    assert _probe("0") == "False False"


def test_no_process_group_means_single_process() -> None:
    assert default_group() is None and ParallelGroups.from_group(None).expert is None
    assert group_size(None) == 1 and group_rank(None) == 0
