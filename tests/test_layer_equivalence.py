"""Every path of MoELayer computes the reference function: outputs, aux loss, all gradients and the
routing counts, on 1 (plain and gloo), 2 and 4 gloo processes."""

from __future__ import annotations

import pytest

from pool import run_distributed

from equivalence import all_cases, check_cases, grid_cases


def _assert_no_failures(results: list[tuple[int, list[str]]], expected_cases: int) -> None:
    failures = [failure for _, rank_failures in results for failure in rank_failures]
    assert all(count == expected_cases for count, _ in results)
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])


@pytest.mark.slow
def test_single_process_without_process_group_matches_reference() -> None:
    cases = all_cases()
    _assert_no_failures([check_cases(0, 1, cases)], len(cases))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.smoke), 4])
def test_expert_parallel_matches_reference(world_size: int) -> None:
    cases = all_cases()
    results = run_distributed(check_cases, world_size, cases, timeout_s=300, collective_timeout_s=60)
    _assert_no_failures(results, len(cases))


@pytest.mark.distributed
def test_expert_groups_on_a_2x2_mesh_match_reference() -> None:
    """The whole table with each layer on an "ep" row of a (dp, ep) = (2, 2) DeviceMesh: every
    technique, algorithm and schedule on an expert group of 2 of the 4 ranks (its node layout from
    the world's), against the reference over that group's tokens; the rows run side by side. The
    routing grid (k, capacity factor, gate, activation) does not depend on the layout: every eighth
    of it runs here, the whole of it on 1, 2 and 4 processes above."""
    grid = grid_cases()
    left_out = {case.name for case in grid} - {case.name for case in grid[1::8]}
    cases = [case for case in all_cases() if case.name not in left_out]
    results = run_distributed(check_cases, 4, cases, "cpu", 2, timeout_s=300, collective_timeout_s=60)
    _assert_no_failures(results, len(cases))
