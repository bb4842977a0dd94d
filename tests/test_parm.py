"""Parm's schedules behind tensor-parallel attention: bad MP groups get clear errors, S1's packing
of its own slots keeps every kept choice, the cost functions order S2 below the DeepSpeed-MoE
baseline as Parm Eq. 10 proves and choose between S1 and S2 as Algorithm 1 does, and ``auto``
switches between them per iteration. (Layer-vs-reference equivalence of S1, S2 with and without
SAA, ``auto`` and the baseline is in ``equivalence.parm_cases``.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.mp import member_rows
from moeflow.comm.topology import Topology
from moeflow.config import LayerDims
from moeflow.parallel.token_share import packed_locations
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.parm import BaselineModel, ParmModel
from moeflow.perf.schedule_models import Plan
from moeflow.perf.shape import RegionShape
from pool import run_distributed


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
        _error(lambda: MoELayer(8, 16, 4, parallel="auto", mp_group=contiguous)),
        _error(lambda: MoELayer(8, 16, 4, group=ParallelGroups(dist.group.WORLD, Topology(4, 4), contiguous),
                                parallel="expert")),
        _error(lambda: MoELayer(8, 16, 4, parallel="s1", alltoall="saa", mp_group=contiguous)),
        _error(lambda: MoELayer(8, 16, 4, parallel="s2", mp_group=contiguous, esp_size=3)),
        _error(lambda: MoELayer(8, 16, 4, parallel="ds-baseline", mp_group=contiguous, esp_size=4)),
    ]


@pytest.mark.distributed
def test_mp_groups_that_do_not_fit_name_the_fix() -> None:
    for messages in run_distributed(_bad_groups, 4, timeout_s=120):
        assert "must be 2 consecutive ranks" in messages[0]
        assert "is not a subgroup of the layer's group" in messages[1]
        assert "mp_group is used by Parm's schedules" in messages[2]
        assert messages[3] == messages[4] == "no error"
        assert "which only Parm's schedules use; got parallel='expert'" in messages[5]
        assert "alltoall='saa'" in messages[6]
        assert "esp_size=3 hidden shards per expert must divide the layer's group of 4 ranks" in messages[7]
        assert "esp_size shards each expert's hidden units" in messages[8]
        assert "parallel='ds-baseline'" in messages[8] and "esp_size=None" in messages[8]


def _layer_shards(rank: int, world: int) -> list[tuple[int, ...]]:
    """Each (N_MP, N_ESP) layout's local w1 shape and the first hidden unit this rank holds."""
    shapes = []
    for mp, esp in ((2, 4), (4, 2), (2, 1), (4, 4)):
        mp_group = dist.new_subgroups(group_size=mp)[0]
        layer = MoELayer(8, 16, 8, parallel="s2", mp_group=mp_group, esp_size=esp)
        first = layer.placement.shards[rank][0]
        shapes.append((*layer.experts.w1.shape, first.expert, first.hidden_start))
    return shapes


@pytest.mark.distributed
def test_n_esp_is_independent_of_n_mp() -> None:
    """Parm's EP x ESP layout for any N_ESP dividing the group (Table III): E / (W / N_ESP) experts
    per rank, H / N_ESP hidden units each, rank ep * N_ESP + esp holding hidden slice esp."""
    for rank, shapes in enumerate(run_distributed(_layer_shards, 4, timeout_s=120)):
        assert shapes[0] == (8, 8, 4, 0, rank * 4)  # N_ESP = 4: all 8 experts, a quarter of each
        assert shapes[1] == (4, 8, 8, rank // 2 * 4, rank % 2 * 8)  # N_ESP = 2 behind N_MP = 4
        assert shapes[2] == (2, 8, 16, rank * 2, 0)  # N_ESP = 1: whole experts behind N_MP = 2
        assert shapes[3] == shapes[0]


def test_parm_schedules_need_an_mp_group() -> None:
    with pytest.raises(ValueError, match=r"parallel='s2' needs mp_group="):
        MoELayer(8, 16, 4, parallel="s2")
    with pytest.raises(ValueError, match=r"parallel='ds-baseline' needs mp_group="):
        MoELayer(8, 16, 4, parallel="ds-baseline")
    with pytest.raises(ValueError, match=r"parallel='s1' needs mp_group="):
        MoELayer(8, 16, 4, parallel="s1")
    with pytest.raises(ValueError, match=r"alltoall='saa' .* needs parallel='s2'"):
        MoELayer(8, 16, 4, alltoall="saa")


@pytest.mark.parametrize("batch_prioritized", [False, True])
def test_s1_packs_each_members_kept_slots_once_in_slot_order(batch_prioritized: bool) -> None:
    from moeflow.core.routing import assign_slots

    generator = torch.Generator().manual_seed(3)
    tokens, top_k, experts, capacity, members = 27, 2, 4, 5, 2
    expert_idx = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    priority = torch.rand(tokens, generator=generator) if batch_prioritized else None
    location, _ = assign_slots(expert_idx, experts, priority)
    packed = [packed_locations(expert_idx, location, capacity, experts, members, m) for m in range(members)]
    assert packed[0][1] == packed[1][1] <= capacity  # every member agrees on the packed capacity
    for member, (packed_TK, packed_capacity) in enumerate(packed):
        start, stop = member_rows(tokens, members, member)
        own_idx, own_loc = expert_idx[start:stop], location[start:stop]
        kept = own_loc < capacity
        assert torch.equal(packed_TK < packed_capacity, kept)  # drops are the whole routing's drops
        for expert in range(experts):
            mine = kept & (own_idx == expert)
            slots = packed_TK[mine]
            assert sorted(slots.tolist()) == list(range(int(mine.sum())))  # dense, each slot once
            assert torch.equal(torch.argsort(slots), torch.argsort(own_loc[mine]))  # slot order kept


def _parm_cost(saa_beta: float) -> CostModel:
    fits = {
        "gemm": AlphaBeta(1e-5, 1e-10), "alltoall.linear": AlphaBeta(1e-4, 1e-8),
        "allgather": AlphaBeta(1e-4, 1e-8), "allgather.intra_node": AlphaBeta(1e-4, 1e-8),
        "allreduce": AlphaBeta(1e-4, 2e-8), "alltoall.saa": AlphaBeta(1e-4, saa_beta),
    }
    return CostModel(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits))


def test_parm_chooses_s2_for_few_slots_and_s1_for_many_as_algorithm_1() -> None:
    """Parm §IV-B: as T -> 0 S2 wins (its all-gather shrinks with the slots), as T grows S1 wins
    (its all-gather of the T x M tokens does not grow with the capacity factor)."""
    cost, model = _parm_cost(1.2e-8), ParmModel("parm", mp_size=2)

    def best(capacity: int) -> Plan:
        shape = RegionShape(LayerDims(256, 1024, 4), 4, capacity, tokens=512)
        plans = model.candidates(shape, (1,), ("linear", "saa"))
        return min(plans, key=lambda plan: model.predict(plan, cost, shape, backward=False).forward_s)

    plans = model.candidates(RegionShape(LayerDims(256, 1024, 4), 4, 64), (1, 2), ("linear", "saa"))
    assert {plan.schedule for plan in plans} == {"s1", "s2"}
    assert best(8).schedule == "s2" and best(8).algorithm == "saa"
    assert best(2048).schedule == "s1"


@pytest.mark.parametrize("esp", [None, 1, 4])
def test_algorithm_1_is_the_closed_form_of_section_5(esp: int | None) -> None:
    """t_D1 = 2 A2A(y) + AG_MP(T M / N_MP) against t_D2 = A2A(y) + Overlap(y), computed by hand from
    the fits (balanced load: S1 sends as many slots as S2), y = N_ESP E C M / N_MP (N_ESP: N_MP when None)."""
    cost, model = _parm_cost(1.2e-8), ParmModel("parm", mp_size=2, esp_size=esp)
    element, model_dim, experts = 4, 256, 4
    for capacity, tokens in [(8, 512), (2048, 512), (64, 64), (512, 4096)]:
        shape = RegionShape(LayerDims(model_dim, 1024, experts), 4, capacity, tokens=tokens)
        y = (esp or 2) * experts * capacity // 2 * model_dim * element  # bytes per member
        t_d1 = 2 * (1e-4 + 1e-8 * y) + 1e-4 + 1e-8 * (tokens // 2 * model_dim * element)
        t_d2 = (1e-4 + 1e-8 * y) + (1e-4 + 1.2e-8 * y)
        choice = model.closed_form(cost, shape)
        assert (choice.t_d1, choice.t_d2) == (pytest.approx(t_d1), pytest.approx(t_d2))
        assert choice.schedule == ("s1" if t_d1 <= t_d2 else "s2")
    assert model.closed_form(cost, RegionShape(LayerDims(256, 1024, 4), 4, 8, tokens=512)).schedule == "s2"
    assert model.closed_form(cost, RegionShape(LayerDims(256, 1024, 4), 4, 2048, tokens=512)).schedule == "s1"


@pytest.mark.parametrize("policy", ["model", "auto"])
def test_auto_takes_algorithm_1s_schedule_before_any_trial(policy: str) -> None:
    """With a calibrated profile the candidates are those of Algorithm 1's schedule only, so the
    model policy and auto's trials choose within it; without one both schedules are timed."""
    from moeflow.parallel.online_planner import OnlinePlanner

    cost, model = _parm_cost(1.2e-8), ParmModel("parm", mp_size=2)
    for capacity, expected in [(8, "s2"), (2048, "s1")]:
        shape = RegionShape(LayerDims(256, 1024, 4), 4, capacity, tokens=512)
        assert model.closed_form(cost, shape).schedule == expected
        planner = OnlinePlanner(policy, ("linear", "saa"), cost, reduce_max=list, schedule=model)
        choice, _ = planner.choose(shape, backward=True)
        assert choice.plan.schedule == expected
        assert {plan.schedule for plan in model.candidates(shape, (1, 2), ("linear", "saa"), cost)} == {expected}
    assert {plan.schedule for plan in model.candidates(shape, (1, 2), ("linear", "saa"))} == {"s1", "s2"}


def _switching_layer(rank: int, world: int) -> list[tuple[str, str]]:
    mp = dist.new_subgroups(group_size=2)[0]
    layer = MoELayer(8, 16, 4, top_k=1, parallel="auto", pipeline=1, mp_group=mp)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(rank // 2))
    seen = []
    for _ in range(11):
        layer(x).sum().backward()
        assert layer.last_stats is not None and layer.last_stats.plan is not None
        seen.append((layer.last_stats.plan.schedule, layer.last_stats.plan.alltoall))
        if seen[-1][0] == "s1":  # its token all-gathers run outside the pipeline, and the trials see them
            assert layer.last_stats.timing.gather_s > 0 and layer.last_stats.timing.backward_s > 0
    return seen


def test_s2_costs_less_than_the_baseline_as_parm_eq10_says() -> None:
    fits = {
        "gemm": AlphaBeta(1e-5, 1e-10), "alltoall.linear": AlphaBeta(1e-4, 1e-8),
        "allgather": AlphaBeta(1e-4, 1e-8), "allreduce": AlphaBeta(1e-4, 2e-8),
    }
    cost = CostModel(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits))
    for capacity in (16, 256, 4096):
        shape = RegionShape(LayerDims(256, 1024, 2), 4, capacity)
        s2 = ParmModel("s2", mp_size=2).predict(Plan("s2", 1, "linear"), cost, shape, backward=True)
        baseline = BaselineModel(mp_size=2).predict(Plan("ds-baseline", 1, "linear"), cost, shape, backward=True)
        assert s2.total_s < baseline.total_s


@pytest.mark.distributed
def test_auto_behind_mp_tries_s1_and_s2_with_and_without_saa_and_keeps_one() -> None:
    for seen in run_distributed(_switching_layer, 4, timeout_s=120):
        assert set(seen[:-1]) == {("s1", "linear"), ("s2", "linear"), ("s2", "saa")}
        assert seen[-1] in set(seen[:-1])  # the dictionary serves the best from then on
