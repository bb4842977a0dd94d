"""The collective ledger: what each rank records of its collectives, and the hang report built from
every rank's progress file (who is behind, who waits where, a desync)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from moeflow import MoELayer
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.ledger import RING_ENTRIES, CollectiveError, CollectiveLedger, ProgressBeacon, process_state
from moeflow.distributed import WorkerError
from moeflow.training.faults import FaultPlan, WorkerFault
from pool import run_distributed


def _failing(ledger: CollectiveLedger, operation: str) -> str:
    with pytest.raises(CollectiveError) as raised, ledger.tracked(operation, None, 64):
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    return str(raised.value)


def test_entries_are_numbered_per_group_and_say_where_the_job_was() -> None:
    ledger = CollectiveLedger()
    with ledger.at(step=7, phase="training"):
        with ledger.at(layer=3, direction="forward"), ledger.tracked("all-to-all", None, 128):
            pass
        assert ledger.location.layer is None  # put back
        with ledger.tracked("all-reduce", None, phase="gradient sync"):
            pass
    first, second = ledger.entries
    assert (first.seq, second.seq) == (1, 2)
    assert first.describe() == "forward all-to-all of layer 3, step 7"
    assert second.describe() == "all-reduce (gradient sync), step 7"
    assert first.finished is not None and first.phase == "forward" and second.phase == "gradient sync"
    for _ in range(2 * RING_ENTRIES):
        with ledger.tracked("all-to-all", None):
            pass
    assert len(ledger.entries) == RING_ENTRIES and ledger.entries[-1].seq == 2 * RING_ENTRIES + 2


def test_a_failed_collective_raises_once_with_the_report() -> None:
    ledger = CollectiveLedger(0, 2)
    message = _failing(ledger, "all-to-all")
    assert message.startswith("worker 0 of 2: all-to-all (collective #1 on local, 64 bytes) failed after")
    assert "Timed out waiting" in message and "progress is unknown" in message
    with pytest.raises(CollectiveError) as raised, ledger.tracked("outer", None), ledger.tracked("inner", None):
        raise CollectiveError("the inner report")
    assert str(raised.value) == "the inner report"  # not wrapped twice


def _two_ranks(tmp_path: Path) -> tuple[CollectiveLedger, CollectiveLedger]:
    return CollectiveLedger(0, 2, tmp_path), CollectiveLedger(1, 2, tmp_path)


def _done(ledger: CollectiveLedger, operation: str, **where: object) -> None:
    with ledger.at(**where), ledger.tracked(operation, None):
        pass


def test_the_report_names_the_worker_that_is_behind(tmp_path: Path) -> None:
    mine, peer = _two_ranks(tmp_path)
    for ledger in (mine, peer):
        _done(ledger, "all-to-all", step=57, layer=2, direction="forward")
    with mine.at(step=57, layer=3, direction="forward"):
        message = _failing(mine, "all-to-all")
    assert "worker 0 of 2: forward all-to-all of layer 3, step 57 (collective #2" in message
    assert "worker 1 of 2 made no progress for 0 s; last entered: forward all-to-all of layer 2, step 57 (finished)" \
        in message


def test_the_report_names_a_desync_and_a_peer_in_the_same_collective(tmp_path: Path) -> None:
    mine, peer = _two_ranks(tmp_path)
    _done(mine, "all-to-all")
    _done(peer, "all-to-all")
    with peer.tracked("all-reduce", None, phase="gradient sync"):  # open: the peer waits there
        with mine.at(layer=1, direction="backward"):
            message = _failing(mine, "all-to-all")
        assert ("desync: worker 1 of 2 waits in all-reduce (gradient sync) (collective #2 on local) while worker 0 "
                "waits in backward all-to-all of layer 1") in message
    with peer.tracked("all-to-all", None):
        message = _failing(mine, "all-to-all")
    assert "worker 1 of 2 entered the same collective (all-to-all)" in message


def test_a_peer_without_a_progress_file_and_process_states(tmp_path: Path) -> None:
    message = _failing(CollectiveLedger(0, 3, tmp_path), "all-gather")
    assert "worker 1 of 3 left no progress record" in message and "worker 2 of 3 left no progress record" in message
    assert process_state(None) != "running"
    assert process_state(_exited_pid()) == "gone"
    beacon = ProgressBeacon.read(tmp_path, 0)
    assert beacon is not None and process_state(beacon["pid"]) == "running"  # this process


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_fault_plan_fires_each_fault_once_at_its_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="phase='dispatch'"):
        WorkerFault("kill", 0, "dispatch")
    with pytest.raises(ValueError, match="kind='pause'"):
        WorkerFault("pause", 0, "forward")
    plan = FaultPlan(workers=(WorkerFault("stop", 1, "backward", step=2), WorkerFault("kill", 1, "evaluation")))
    assert plan.injector(0) is None
    fired: list[tuple[str, int]] = []
    monkeypatch.setattr(WorkerFault, "fire", lambda fault: fired.append((fault.kind, len(ledger.entries))))
    ledger = CollectiveLedger(1, 2, on_enter=plan.injector(1))
    for step in (1, 2):
        for direction in ("forward", "backward", "backward"):
            _done(ledger, "all-to-all", step=step, phase="training", layer=0, direction=direction)
    _done(ledger, "all-reduce", step=2, phase="evaluation")
    _done(ledger, "all-reduce", step=3, phase="evaluation")
    assert fired == [("stop", 5), ("kill", 7)]  # the first backward of step 2; the first evaluation


def _layer_entries(rank: int, world_size: int, settings: dict[str, object]) -> list[tuple[int, str]]:
    torch.manual_seed(0)
    groups = ParallelGroups.from_group(None)
    layer = MoELayer(16, 32, 2 * world_size, top_k=2, group=groups, **settings)
    layer.index = 3
    x = torch.randn(8, 16, requires_grad=True)
    with groups.ledger.at(step=7, phase="training"):
        layer(x).sum().backward()
    return [(entry.seq, entry.describe()) for entry in groups.ledger.entries]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.slow
def test_the_layer_records_its_collectives_alike_on_every_rank(world_size: int) -> None:
    per_rank = run_distributed(_layer_entries, world_size, {"pipeline": 2})
    assert all(entries == per_rank[0] for entries in per_rank)  # the same numbers for the same collectives
    described = [text for _, text in per_rank[0]]
    assert described[0] == "forward load all-gather of layer 3, step 7"
    assert described.count("forward all-to-all of layer 3, step 7") == 4  # 2 chunks, dispatch and combine
    assert described.count("backward all-to-all of layer 3, step 7") == 4
    assert np.all(np.diff([seq for seq, _ in per_rank[0]]) == 1)


def test_shadowing_records_its_weight_all_reduces() -> None:
    per_rank = run_distributed(_layer_entries, 2, {"pipeline": 1, "shadowing": [0]})
    assert per_rank[0] == per_rank[1]
    described = [text for _, text in per_rank[0]]
    assert "forward shadowed weight all-reduce of layer 3, step 7" in described
    assert "backward shadowed gradient all-reduce of layer 3, step 7" in described


def _s1_entries(rank: int, world_size: int) -> list[tuple[int, str]]:
    """Parm's S1 over MP groups of 2: each member routes its own partition."""
    import torch.distributed as dist

    from moeflow.comm.topology import Topology

    torch.manual_seed(0)
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, world_size), dist.new_subgroups(group_size=2)[0])
    layer = MoELayer(16, 32, 4, top_k=2, group=groups, parallel="s1", pipeline=1)
    x = torch.randn(8, 16, requires_grad=True)
    with groups.ledger.at(step=7, phase="training"):
        layer(x).sum().backward()
    return [(entry.seq, entry.describe()) for entry in groups.ledger.entries]


def test_parms_s1_records_its_partition_all_gather() -> None:
    per_rank = run_distributed(_s1_entries, 2)
    assert per_rank[0] == per_rank[1]
    described = [text for _, text in per_rank[0]]
    assert described[:2] == ["forward load all-gather, step 7", "forward S1 partition all-gather, step 7"]


def _desynchronized(rank: int, world_size: int, progress: str) -> None:
    """Rank 1 skips a collective the others make: each then waits in a different operation."""
    import torch.distributed as dist

    ledger = CollectiveLedger(rank, world_size, Path(progress))
    with ledger.at(step=57, phase="training"):
        if rank != 1:
            with ledger.at(layer=3, direction="forward"), ledger.tracked("all-to-all", dist.group.WORLD, 32):
                dist.all_to_all_single(torch.empty(8), torch.ones(8))
        with ledger.tracked("all-reduce", dist.group.WORLD, 8, phase="gradient sync"):
            dist.all_reduce(torch.ones(2))


@pytest.mark.slow
def test_workers_in_different_collectives_are_reported_as_a_desync(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as raised:
        run_distributed(_desynchronized, 2, str(tmp_path), collective_timeout_s=3)
    message = str(raised.value)
    assert re.search(r"desync: worker [01] of 2 waits in", message), message[-3000:]
    assert "forward all-to-all of layer 3, step 57" in message and "all-reduce (gradient sync), step 57" in message
