"""Topology-aware settings on an expert group of some of the world's ranks (issue 63, item 2): given
the world's topology, a DeviceMesh's "ep" group knows its own node layout, so 2DH, the pairwise
exchange and FasterMoE's smart schedule run on it and equal the linear all-to-all (outputs and
gradients, fp32), and the topology-aware gate marks the experts of the group's node. Rows of a
(dp, ep) mesh and its columns (whose ranks are not consecutive) both."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from moeflow import MoELayer
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import Topology, group_topology
from pool import run_distributed

SETTINGS = ({"alltoall": "pairwise", "pipeline": 1}, {"alltoall": "2dh", "pipeline": 1}, {"pipeline": "smart"},
            {"alltoall": "pairwise", "pipeline": 2})
"""What runs against the linear all-to-all on each expert group."""


def _run(layer: MoELayer, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    assert x.grad is not None
    return [y.detach(), x.grad, *(p.grad for p in layer.experts.parameters())]


def _layer(groups: ParallelGroups, **settings: Any) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(8, 16, 8, top_k=2, capacity_factor=0.0, parallel="expert", group=groups, **settings)


def _on_subgroups(rank: int, world_size: int, ranks_per_node: int, dims: tuple[str, str]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=dims)
    groups = ParallelGroups.from_group(mesh["ep"].get_group(), Topology(world_size, ranks_per_node))
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(rank))
    linear = _run(_layer(groups, alltoall="linear", pipeline=1), x)
    differences, plans = [], []
    for settings in SETTINGS:
        layer = _layer(groups, **settings)
        got = _run(layer, x)
        differences.append(max(float((a - b).abs().max()) for a, b in zip(got, linear, strict=True)))
        assert layer.last_stats is not None and layer.last_stats.plan is not None
        plans.append((layer.last_stats.plan.schedule, layer.last_stats.plan.alltoall))
    gate = _layer(groups, topology_gate=0.5).node_limit
    assert gate is not None
    return {"members": groups.members, "nodes": (groups.topology.num_nodes, groups.topology.ranks_per_node),
            "differences": differences, "plans": plans, "node_experts": gate.local_E.nonzero().flatten().tolist()}


@pytest.mark.distributed
@pytest.mark.parametrize(("ranks_per_node", "dims", "members", "nodes"), [
    (1, ("dp", "ep"), [(0, 1), (2, 3)], (2, 1)),  # mesh rows: two nodes of one rank each
    (2, ("ep", "dp"), [(0, 2), (1, 3)], (2, 1)),  # mesh columns: a rank from each of two nodes
])
def test_topology_aware_settings_run_on_a_mesh_group_and_equal_the_linear_exchange(
    ranks_per_node: int, dims: tuple[str, str], members: list[tuple[int, int]], nodes: tuple[int, int],
) -> None:
    results = run_distributed(_on_subgroups, 4, ranks_per_node, dims)
    for rank, result in enumerate(results):
        group = next(m for m in members if rank in m)
        assert result["members"] == group and result["nodes"] == nodes
        assert max(result["differences"]) < 1e-6, result["differences"]
        assert result["plans"] == [("expert", "pairwise"), ("expert", "2dh"), ("smart", "pairwise"),
                                   ("expert", "pairwise")]
        # 8 experts over 2 group ranks, one per node: the gate's node holds this rank's 4 experts
        own = group.index(rank)
        assert result["node_experts"] == list(range(own * 4, own * 4 + 4))


def _uneven_group(rank: int, world_size: int) -> list[str]:
    """Ranks {0, 1, 2} of two nodes of two: the layer builds (linear) and refuses 2DH with the reason."""
    import torch.distributed as dist

    group, _ = dist.new_subgroups_by_enumeration([[0, 1, 2], [3]])  # every rank makes both, in one order
    groups = ParallelGroups.from_group(group, Topology(world_size, 2))
    if rank == 3:
        return []
    MoELayer(8, 16, 6, group=groups, alltoall="linear")
    try:
        MoELayer(8, 16, 6, group=groups, alltoall="2dh")
    except ValueError as error:
        return [str(error), str(groups.knows_nodes)]
    return ["no error"]


@pytest.mark.distributed
def test_an_expert_group_uneven_over_the_nodes_runs_linear_and_refuses_2dh_with_the_reason() -> None:
    for result in run_distributed(_uneven_group, 4)[:3]:
        assert "lie {0: 2, 1: 1} per node" in result[0] and result[1] == "False", result


def test_a_group_that_is_not_node_major_or_uneven_over_the_nodes_is_refused() -> None:
    world = Topology(8, 4)  # two nodes of four ranks
    assert group_topology([0, 1, 4, 5], world) == Topology(4, 2)
    assert group_topology([2, 6], world) == Topology(2, 1)
    with pytest.raises(ValueError, match=r"lie \{0: 3, 1: 1\} per node"):
        group_topology([0, 1, 2, 4], world)
    with pytest.raises(ValueError, match="in node order"):
        group_topology([4, 0], world)


def _fake_nccl(store: object, rank: int, size: int, timeout: object) -> object:
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _subgroup_backends(rank: int, world_size: int) -> list[str]:
    """An expert group of gloo for host values beside a (fake) NCCL for tensors, as torch's
    ``"cpu:gloo,cuda:nccl"``: its node groups and blocks are made on the same backend."""
    import torch.distributed as dist

    if "fakenccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("fakenccl", _fake_nccl, devices=["cuda"])
    expert = dist.new_group(list(range(world_size)), backend="cpu:gloo,cuda:fakenccl")
    groups = ParallelGroups(expert, Topology(world_size, 2))
    hops = groups.node_groups()
    return [str(dist.get_backend(group)) for group in (expert, hops.intra_node, hops.inter_node, groups.block(2))]


@pytest.mark.distributed
def test_subgroups_take_the_expert_groups_backend() -> None:
    """Host values travel on the expert group's host device: node dedup's index exchange on a node
    subgroup made with the default backend put a CPU tensor into NCCL beside a cpu:gloo group."""
    for backends in run_distributed(_subgroup_backends, 4):
        assert len(set(backends)) == 1 and "cpu:gloo" in backends[0], backends


def _groups_made_in_steps(rank: int, world_size: int) -> list[str]:
    """Layers built on 2 nodes of 2 (2DH with node dedup; Tutel's adaptive r, whose weight-gather
    groups are blocks): the groups made during their forwards and backwards (none may be)."""
    import torch.distributed as dist

    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, 2))
    layers = [MoELayer(8, 16, 4, top_k=2, capacity_factor=0.0, group=groups, alltoall="2dh",
                       token_exchange="dedup", parallel="expert"),
              MoELayer(8, 16, 2, top_k=1, capacity_factor=0.0, group=groups, parallel="adaptive", alltoall="linear")]
    made: list[str] = []
    new_group = dist.new_group
    dist.new_group = lambda ranks=None, *args, **kwargs: made.append(str(ranks)) or new_group(ranks, *args, **kwargs)
    try:
        for layer in layers:
            for r in (0, 1, 2) if layer.config.parallel == "adaptive" else (None,):
                x = torch.randn(12, 8, generator=torch.Generator().manual_seed(rank))
                y = layer(x) if r is None else layer(x, r=r)
                y.sum().backward()
    finally:
        dist.new_group = new_group
    return made


@pytest.mark.distributed
def test_no_group_is_made_after_the_layers_are_built() -> None:
    """NCCL makes a subgroup only when every rank of the world takes part: every group a layer may
    use is made with its ParallelGroups (the node groups and blocks were made on first use, by
    their members alone)."""
    assert run_distributed(_groups_made_in_steps, 4) == [[]] * 4
