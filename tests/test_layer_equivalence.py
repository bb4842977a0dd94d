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


def _grid_left_out(world_size: int) -> list[str]:
    """The routing grid's cases a world leaves out: 1 process runs the whole grid, 2 and 4 processes
    one half each (every other case, the halves complementary), so that every grid case also runs
    expert parallel. The grid varies the routing (k, capacity factor, gate, activation), not the
    path, and every other case runs on every world."""
    grid = grid_cases()
    return [] if world_size == 1 else [case.name for case in grid[world_size // 4::2]]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.smoke), 4])
def test_expert_parallel_matches_reference(world_size: int) -> None:
    left_out = set(_grid_left_out(world_size))
    cases = [case for case in all_cases() if case.name not in left_out]
    results = run_distributed(check_cases, world_size, cases, timeout_s=300, collective_timeout_s=60)
    _assert_no_failures(results, len(cases))


def test_two_and_four_processes_share_the_routing_grid_between_them() -> None:
    grid = {case.name for case in grid_cases()}
    left_out_2, left_out_4 = set(_grid_left_out(2)), set(_grid_left_out(4))
    assert not left_out_2 & left_out_4 and left_out_2 | left_out_4 == grid and not _grid_left_out(1)


@pytest.mark.distributed
def test_expert_groups_on_a_2x2_mesh_match_reference() -> None:
    """The whole table with each layer on an "ep" row of a (dp, ep) = (2, 2) DeviceMesh: every
    technique, algorithm and schedule on an expert group of 2 of the 4 ranks (its node layout from
    the world's), against the reference over that group's tokens; the rows run side by side. The
    routing grid (k, capacity factor, gate, activation) does not depend on the layout: every eighth
    of it runs here; above, the whole of it on 1 process and a half each on 2 and 4."""
    grid = grid_cases()
    left_out = {case.name for case in grid} - {case.name for case in grid[1::8]}
    cases = [case for case in all_cases() if case.name not in left_out]
    results = run_distributed(check_cases, 4, cases, "cpu", 2, timeout_s=300, collective_timeout_s=60)
    _assert_no_failures(results, len(cases))
