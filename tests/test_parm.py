"""Parm's schedules behind tensor-parallel attention: bad MP groups get clear errors, and the cost
functions order S2 below the DeepSpeed-MoE baseline as Parm Eq. 10 proves. (Layer-vs-reference
equivalence of S2 and the baseline is in ``equivalence.parm_cases``.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.distributed import run_distributed
from moeflow.parallel.parm import BaselineModel, ParmS2Model
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.pipeline import RegionShape
from moeflow.perf.schedules import Plan


def _error(build) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "no error"


def _bad_groups(rank: int, world: int) -> list[str]:
    contiguous = dist.new_subgroups(group_size=2)[0]  # {0, 1}, {2, 3}
    strided = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0]
    return [
        _error(lambda: MoELayer(8, 16, 4, parallel="s2", mp_group=strided)),
        _error(lambda: MoELayer(8, 16, 4, group=contiguous, parallel="s2", mp_group=strided)),
        _error(lambda: MoELayer(8, 16, 4, parallel="expert", mp_group=contiguous)),
        _error(lambda: MoELayer(8, 16, 4, parallel="s2", mp_group=contiguous)),
    ]


@pytest.mark.distributed
def test_mp_groups_that_do_not_fit_name_the_fix() -> None:
    for messages in run_distributed(_bad_groups, 4, timeout_s=120):
        assert "must be 2 consecutive ranks" in messages[0]
        assert "is not a subgroup of the layer's group" in messages[1]
        assert "mp_group is used by Parm's schedules" in messages[2]
        assert messages[3] == "no error"


def test_parm_schedules_need_an_mp_group() -> None:
    with pytest.raises(ValueError, match=r"parallel='s2' needs mp_group="):
        MoELayer(8, 16, 4, parallel="s2")
    with pytest.raises(ValueError, match=r"parallel='ds-baseline' needs mp_group="):
        MoELayer(8, 16, 4, parallel="ds-baseline")


def test_s2_costs_less_than_the_baseline_as_parm_eq10_says() -> None:
    fits = {
        "gemm": AlphaBeta(1e-5, 1e-10), "alltoall.linear": AlphaBeta(1e-4, 1e-8),
        "allgather": AlphaBeta(1e-4, 1e-8), "allreduce": AlphaBeta(1e-4, 2e-8),
    }
    cost = CostModel(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits))
    for capacity in (16, 256, 4096):
        shape = RegionShape(2, 4, capacity, 256, 1024)
        s2 = ParmS2Model(mp_size=2).predict(Plan("s2", 1, "linear"), cost, shape, backward=True)
        baseline = BaselineModel(mp_size=2).predict(Plan("ds-baseline", 1, "linear"), cost, shape, backward=True)
        assert s2.total_s < baseline.total_s
