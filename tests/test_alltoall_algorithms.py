"""Every all-to-all algorithm moves exactly the rows the linear one moves, forward and backward, on
1x2, 2x2, 1x4 and 4x1 layouts (nodes x ranks per node), with equal, uneven and empty splits."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from moeflow.comm.algorithms import ALGORITHMS, all_to_all_with, exchange, pairwise_peers, split_matrix, transpose
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import Topology, topology_from_environment
from pool import run_distributed

SPLIT_KINDS = ("equal", "uneven", "empty")


def _splits(kind: str, rank: int, world_size: int) -> list[int] | None:
    if kind == "equal":
        return None
    if kind == "empty":
        return [0] * world_size
    generator = torch.Generator().manual_seed(100 + rank)
    splits = torch.randint(0, 4, (world_size,), generator=generator).tolist()
    splits[(rank + 1) % world_size] = 0  # at least one empty chunk
    return splits


def _exchange(rank: int, world_size: int, ranks_per_node: int) -> list[str]:
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, ranks_per_node))
    failures = []
    for kind in SPLIT_KINDS:
        in_splits = _splits(kind, rank, world_size)
        rows = 3 * world_size if in_splits is None else sum(in_splits)
        x = torch.randn(rows, 5, generator=torch.Generator().manual_seed(rank))
        matrix = split_matrix(x, world_size, in_splits)
        out_splits = None if in_splits is None else [matrix[s][rank] for s in range(world_size)]
        results = {}
        for algorithm in ALGORITHMS:
            leaf = x.clone().requires_grad_()
            out = all_to_all_with(algorithm, leaf, groups, in_splits, out_splits)
            upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank))
            (out * upstream).sum().backward()
            results[algorithm] = (out.detach(), leaf.grad)
        for algorithm in ALGORITHMS:
            for what, got, expected in zip(("output", "grad"), results[algorithm], results["linear"], strict=True):
                if not torch.equal(got, expected):
                    failures.append(f"rank {rank} {algorithm} {kind}: {what} differs from linear")
            # outside autograd, on a split matrix every rank knows: the same rows, and the adjoint
            # (the transposed matrix) carries the upstream gradient back as autograd does
            upstream = torch.randn(results["linear"][0].shape, generator=torch.Generator().manual_seed(7 + rank))
            known = exchange(algorithm, x, groups, matrix)
            back = exchange(algorithm, upstream, groups, transpose(matrix))
            for what, got, expected in zip(("known-matrix output", "adjoint"), (known, back), results["linear"],
                                           strict=True):
                if not torch.equal(got, expected):
                    failures.append(f"rank {rank} {algorithm} {kind}: {what} differs from linear")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "ranks_per_node"), [(2, 2), (4, 2), (4, 4), (4, 1)])
def test_algorithms_equal_linear(world_size: int, ranks_per_node: int) -> None:
    results = run_distributed(_exchange, world_size, ranks_per_node, timeout_s=180)
    failures = [failure for rank_failures in results for failure in rank_failures]
    assert not failures, "\n".join(failures)


def test_topology_numbering_and_errors() -> None:
    topology = Topology(world_size=8, ranks_per_node=2)
    assert topology.num_nodes == 4
    assert (topology.node_of(5), topology.local_rank_of(5), topology.rank_of(2, 1)) == (2, 1, 5)
    with pytest.raises(ValueError, match="not a multiple of ranks per node 3"):
        Topology(world_size=8, ranks_per_node=3)
    assert topology_from_environment({"LOCAL_WORLD_SIZE": "2"}, 4) == Topology(4, 2)
    assert topology_from_environment({}, 4) == Topology(4, 4)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be an integer"):
        topology_from_environment({"LOCAL_WORLD_SIZE": "two"}, 4)


def test_pairwise_schedule_covers_every_pair_once() -> None:
    topology = Topology(world_size=6, ranks_per_node=2)
    for rank in range(6):
        sent = [d for step in range(topology.num_nodes) for d in pairwise_peers(topology, rank, step)[0]]
        received = [s for step in range(topology.num_nodes) for s in pairwise_peers(topology, rank, step)[1]]
        assert sorted(sent) == list(range(6)) and sorted(received) == list(range(6))
        # step 0 stays inside the node (FasterMoE: the fastest exchange first)
        assert pairwise_peers(topology, rank, 0)[0] == [2 * (rank // 2), 2 * (rank // 2) + 1]


def test_unknown_algorithm_and_bad_splits_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown alltoall algorithm 'ring'"):
        all_to_all_with("ring", torch.zeros(2, 1), ParallelGroups.single_process())
    with pytest.raises(ValueError, match="cannot be split equally over 3 ranks"):
        split_matrix(torch.zeros(4, 1), 3, None)


def run_in_launched_rank() -> None:
    """Entry point for ranks started by ``moeflow launch``: exit 1 on any mismatch."""
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    failures = _exchange(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"]))  # an entry point
    dist.destroy_process_group()
    print("\n".join(failures) or "all algorithms equal linear", flush=True)
    raise SystemExit(1 if failures else 0)
