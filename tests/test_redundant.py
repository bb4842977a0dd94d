"""EPLB's redundant experts: the hierarchical placement, the split of a replicated expert's tokens,
training across rebalances (weights and optimizer state moved once per change), and the errors.
(That a layer with redundant slots equals the reference, outputs and gradients, before and after
a rebalance, is in the equivalence table: the ``redundant-*`` cases on 1, 2 and 4 processes.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.parallel.redundant import ReplicaRowMap, balanced_placement, rank_loads
from moeflow.perf.replicas import replica_counts
from moeflow.training.rebalance import rebalance_layer
from pool import run_distributed


def _experts_of(placement: Any) -> list[list[int]]:
    return placement.experts_per_rank()


def test_the_hot_expert_gets_the_extra_slots_up_to_one_per_rank() -> None:
    assert replica_counts([100, 1, 1, 1], 6, max_per_expert=2) == [2, 2, 1, 1]
    assert replica_counts([100, 1, 1, 1], 6, max_per_expert=6) == [3, 1, 1, 1]


def test_a_one_hot_load_is_spread_over_every_rank() -> None:
    placement = balanced_placement([1000, 1, 1, 1], 3, Topology(2, 1), hidden_dim=4)
    assert all(0 in experts for experts in _experts_of(placement))
    loads = rank_loads(placement, [1000, 1, 1, 1])
    assert max(loads) / np.mean(loads) < 1.01


@pytest.mark.parametrize("skew", [0.6, 1.2, 2.0])
def test_zipf_loads_end_within_ten_percent_of_the_mean(skew: float) -> None:
    load = 1.0 / np.arange(1, 17) ** skew
    placement = balanced_placement(load.tolist(), 6, Topology(4, 2), hidden_dim=4)  # 24 slots, 2 nodes
    loads = rank_loads(placement, load.tolist())
    assert max(loads) / np.mean(loads) <= 1.1
    for experts in _experts_of(placement):
        assert len(experts) == len(set(experts)) == 6  # no rank holds an expert twice


def test_nodes_are_balanced_before_ranks() -> None:
    load = [50, 40, 5, 5, 1, 1, 1, 1]
    placement = balanced_placement(load, 2, Topology(4, 2), hidden_dim=4)  # 8 slots: no replicas
    loads = rank_loads(placement, load)
    assert abs((loads[0] + loads[1]) - (loads[2] + loads[3])) <= 12  # 50 and 40 on different nodes


def test_replicas_split_each_expert_once_over_its_slots_evening_out_the_ranks() -> None:
    placement = balanced_placement([1000, 1, 1, 1], 3, Topology(2, 1), hidden_dim=4)
    filled_WE = torch.tensor([[7, 1, 0, 2], [7, 0, 3, 0]])
    row_maps = [ReplicaRowMap.of(placement, filled_WE, capacity=8, rank=r) for r in range(2)]
    slot_experts = [s.expert for shards in placement.shards for s in shards]
    filled_WP = row_maps[0].filled_WP
    for expert in range(4):
        columns = [p for p, e in enumerate(slot_experts) if e == expert]
        assert filled_WP[:, columns].sum(1).tolist() == filled_WE[:, expert].tolist()
    assert filled_WP.view(2, 2, 3).sum(dim=(0, 2)).tolist() == [10, 10]  # each rank computes half the tokens
    zero_replica = [p for p, e in enumerate(slot_experts) if e == 0]
    # the rank whose replica takes more of expert 0 keeps all its own tokens of it at home
    keeper = int(filled_WP[:, zero_replica].sum(0).argmax())
    assert filled_WP[keeper, zero_replica[keeper]] == 7
    assert row_maps[0].exchanged_WP[keeper, zero_replica].sum() == 0
    assert row_maps[0].exchanged_rows_PC.shape == row_maps[1].exchanged_rows_PC.shape  # one exchange shape

    dispatched_ECM = torch.randn(4, 8, 5)
    back = row_maps[1].scatter(ReplicaRowMap.gather(dispatched_ECM, row_maps[1].exchanged_rows_PC),
                             ReplicaRowMap.gather(dispatched_ECM, row_maps[1].local_rows_SC), 4)
    for expert, count in enumerate(filled_WE[1].tolist()):
        assert torch.equal(back[expert, :count], dispatched_ECM[expert, :count])


def _train(rank: int, world_size: int, redundant: int, loads: list[list[float]]) -> dict[str, np.ndarray]:
    """Three AdamW steps on skewed tokens; the redundant layer rebalances before steps 1 and 2."""
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, 1))
    torch.manual_seed(3)
    layer = MoELayer(8, 12, 4, top_k=2, capacity_factor=0.0, group=groups, parallel="expert",
                     redundant_experts=redundant)
    reference = MoELayer(8, 12, 4, top_k=2, capacity_factor=0.0, group=groups, parallel="expert")
    torch.manual_seed(4)
    full = {name: torch.randn_like(t) * 0.3 for name, t in reference.full_state_dict().items()}
    layer.load_full_state_dict(full)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    for step in range(3):
        if step and redundant:
            assert rebalance_layer(layer, loads[step - 1], optimizer)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank)).abs()
        ((layer(x) ** 2).sum() + layer.aux_loss).backward()
        for name, parameter in layer.named_parameters():
            if not name.startswith("experts."):  # the gate is replicated: average it as a trainer would
                dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.numpy() for name, tensor in layer.full_state_dict().items()}


@pytest.mark.slow
def test_training_across_rebalances_continues_as_without_redundant_experts() -> None:
    loads = [[1.0, 2, 90, 3], [60.0, 1, 1, 50]]  # replicas of experts 2, 3 then 0, 3 (0, 1 at first)
    plain = run_distributed(_train, 2, 0, loads, timeout_s=180)
    redundant = run_distributed(_train, 2, 2, loads, timeout_s=180)
    for name, tensor in plain[0].items():
        for rank in range(2):
            np.testing.assert_allclose(redundant[rank][name], tensor, rtol=1e-5, atol=1e-6, err_msg=name)


def _stats(rank: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, 1))
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, top_k=1, capacity_factor=0.0, group=groups, parallel="expert", redundant_experts=2)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[3, 0] = 10.0  # every token to expert 3, which starts with one slot
        x = torch.ones(10, 8)
        layer(x)
        before = layer.last_stats.rank_tokens
        moved = rebalance_layer(layer, layer.last_stats.tokens_per_expert)
        layer(x)
    return before, layer.last_stats.rank_tokens, moved


def test_a_rebalance_evens_the_ranks_tokens_for_the_recorded_load() -> None:
    results = run_distributed(_stats, 2, timeout_s=120)
    before, after, moved = results[0]
    assert moved and sorted(before) == [0, 20] and after == (10, 10)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"redundant_experts": -1}, "redundant_experts must be an int >= 0"),
    ({"redundant_experts": 1, "shadowing": [0]}, "shadowing='off'"),
    ({"redundant_experts": 2, "parallel": "replicated"}, "parallel='expert'"),
])
def test_bad_settings_name_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoELayer(8, 12, 4, **kwargs)


def test_rebalance_checks_its_load_and_the_layer() -> None:
    with pytest.raises(ValueError, match="redundant_experts > 0"):
        rebalance_layer(MoELayer(8, 12, 4, parallel="expert"), [1.0] * 4)
    with pytest.raises(ValueError, match="one per expert"):
        rebalance_layer(MoELayer(8, 12, 4, parallel="expert", redundant_experts=1), [1.0] * 3)


def _uneven(rank: int, world_size: int) -> None:
    MoELayer(8, 12, 4, group=ParallelGroups(dist.group.WORLD, Topology(world_size, 1)), parallel="expert",
             redundant_experts=1)


@pytest.mark.slow
def test_slots_must_split_evenly_over_the_ranks() -> None:
    with pytest.raises(Exception, match="multiple of 2"):
        run_distributed(_uneven, 2, timeout_s=60)
