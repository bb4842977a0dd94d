"""Every collective goes through ``moeflow.comm``, and host values travel where the group can
carry them: CPU tensors only on a group with a CPU backend (gloo, or "cpu:gloo,cuda:nccl")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moeflow
from moeflow.comm.collectives import (
    all_gather_objects,
    broadcast_objects,
    carries_cpu_tensors,
    host_device,
    reduce_values,
    send_and_receive,
)
from pool import run_distributed

SOURCE = Path(moeflow.__file__).parent
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "gather", "scatter", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list",
})
"""torch.distributed's collectives and point-to-point calls."""
DISTRIBUTED_NAMES = ("dist", "torch.distributed", "c10d")


def direct_collectives(package: Path) -> list[str]:
    """Where a module outside ``moeflow/comm`` names a torch.distributed collective (a call, or a
    reference such as ``P2POp(dist.isend, ...)``) or imports one by name."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative.startswith("comm/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES \
                    and ast.unparse(node.value) in DISTRIBUTED_NAMES:
                found.append((relative, node.lineno, ast.unparse(node)))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed") and (
                    "_functional_collectives" in (node.module or "")
                    or any(alias.name in COLLECTIVES for alias in node.names)):
                found.append((relative, node.lineno, f"from {node.module} import ..."))
    return [f"{relative}:{line} {text}" for relative, line, text in sorted(found)]


def test_every_collective_goes_through_moeflow_comm() -> None:
    assert direct_collectives(SOURCE) == []


def test_the_check_sees_a_direct_collective(tmp_path: Path) -> None:
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "ok.py").write_text("import torch.distributed as dist\ndist.all_reduce(x)\n")
    (tmp_path / "bad.py").write_text("import torch.distributed as dist\nops = [dist.P2POp(dist.isend, t, 1)]\n"
                                     "torch.distributed.barrier()\n")
    (tmp_path / "worse.py").write_text("from torch.distributed import all_gather\n")
    assert direct_collectives(tmp_path) == ["bad.py:2 dist.isend", "bad.py:3 torch.distributed.barrier",
                                            "worse.py:1 from torch.distributed import ..."]


@pytest.mark.parametrize(("backend", "cpu"), [
    ("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", False), ("GLOO", True),
])
def test_host_values_stay_on_the_cpu_only_where_the_group_carries_cpu_tensors(backend: str, cpu: bool) -> None:
    assert carries_cpu_tensors(backend) is cpu


def _collectives_worker(rank: int, world_size: int) -> dict[str, object]:
    peer = (rank + 1) % world_size
    source = (rank - 1) % world_size
    sent = torch.full((3,), float(rank))
    received = torch.empty(3)
    for request in send_and_receive([(sent, peer)], [(received, source)]):  # a ring: both ways at once
        request.wait()
    job = [f"run-{rank}"]
    broadcast_objects(job, 0)
    return {"device": str(host_device(dist.group.WORLD)), "received": received.tolist(),
            "max": reduce_values([rank, -rank], None, "max"), "sum": reduce_values([1.0], None),
            "objects": all_gather_objects({"rank": rank}), "job": job[0]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_collectives_on_gloo(world_size: int) -> None:
    results = run_distributed(_collectives_worker, world_size)
    for rank, result in enumerate(results):
        assert result["device"] == "cpu" and result["job"] == "run-0"
        assert result["received"] == [float((rank - 1) % world_size)] * 3
        assert result["max"] == [world_size - 1, 0] and result["sum"] == [world_size]
        assert result["objects"] == [{"rank": r} for r in range(world_size)]


def _gather_and_scatter_worker(rank: int, world_size: int) -> dict[str, object]:
    import warnings

    from moeflow.comm.collectives import all_gather_into, reduce_scatter_into

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = torch.empty(world_size * 2)
        all_gather_into(gathered, torch.full((2,), float(rank)), dist.group.WORLD)
        scattered = torch.empty(2)
        reduce_scatter_into(scattered, torch.arange(world_size * 2, dtype=torch.float32), dist.group.WORLD)
    return {"gathered": gathered.tolist(), "scattered": scattered.tolist(),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def test_gather_into_and_reduce_scatter_into_compute_without_a_deprecation_warning() -> None:
    """torch 2.13 renamed both (``*_single``) and warns on the old names, which torch 2.11 alone has:
    each worker of every run printed the warning."""
    for rank, result in enumerate(run_distributed(_gather_and_scatter_worker, 2)):
        assert result["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert result["scattered"] == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert result["warnings"] == []
