"""The direct exchange (moeflow.direct_exchange): a small no-grad forward under expert parallelism
sends each choice's row straight to its expert's rank and back, with no capacity buffer. On 2 and
4 gloo processes it computes what the capacity path and the reference compute, every rank decides
alike (uneven and empty ranks included), and it is taken only where it may be."""

from __future__ import annotations

import inspect

import pytest
import torch

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.direct import SOURCE
from moeflow.direct_exchange import DIRECT_EXCHANGE_ROWS, exchanges_directly
from moeflow.distributed import run_distributed
from moeflow.reference import ReferenceMoE
from moeflow.routing.load import GlobalLoad
from op_count import OpCount

M, H, E = 16, 24, 8

CASES = {
    "k2-gelu": {"top_k": 2, "capacity_factor": 0.0},
    "k3-swiglu-shared": {"top_k": 3, "capacity_factor": 0.0, "activation": "swiglu", "bias": False,
                         "num_shared_experts": 1},
    "k2-relu-f4": {"top_k": 2, "capacity_factor": 4.0, "activation": "relu"},  # C >= T: drops nothing
}


def test_small_dropless_loads_exchange_directly() -> None:
    load = GlobalLoad(torch.tensor([[3, 1], [0, 2]]), max_tokens_per_rank=2)
    assert exchanges_directly(load, top_k=2, capacity=3)
    assert not exchanges_directly(load, top_k=2, capacity=2)  # the capacity path would drop one
    big = GlobalLoad(load.counts_WE, max_tokens_per_rank=DIRECT_EXCHANGE_ROWS // 2 + 1)
    assert not exchanges_directly(big, top_k=2, capacity=3)


def _pair(world_size: int, settings: dict) -> tuple[MoELayer, ReferenceMoE]:
    torch.manual_seed(0)
    reference_settings = {k: v for k, v in settings.items() if k in inspect.signature(ReferenceMoE).parameters}
    reference = ReferenceMoE(M, H, E, **reference_settings)
    groups = ParallelGroups(torch.distributed.group.WORLD, Topology(world_size, 2 if world_size > 2 else 1))
    layer = MoELayer(M, H, E, parallel="expert", group=groups, **settings)
    layer.load_full_state_dict(reference.state_dict())
    return layer, reference


def _equivalence(rank: int, world_size: int, settings: dict, tokens: tuple[int, ...]) -> list[str]:
    layer, reference = _pair(world_size, settings)
    x = torch.randn(tokens[rank], M, generator=torch.Generator().manual_seed(rank + 7))
    with torch.no_grad():
        direct = layer(x)
        stats = layer.last_stats
        expected = reference(x)
    capacity_path = layer(x).detach()  # grad enabled: the capacity path
    failures = []
    if stats.plan.source != SOURCE or layer.last_stats.plan.source == SOURCE:
        failures.append(f"rank {rank}: sources {stats.plan.source}, {layer.last_stats.plan.source}")
    if stats.plan.world_size != world_size or stats.plan.token_exchange != "ragged" or stats.dropped:
        failures.append(f"rank {rank}: stats {stats.plan}")
    if not 0 < stats.timing.expert_forward_s < stats.timing.forward_s and tokens[rank]:
        failures.append(f"rank {rank}: timing {stats.timing}")
    if stats.num_tokens != sum(tokens) or sum(stats.rank_tokens) != sum(tokens) * layer.config.top_k:
        failures.append(f"rank {rank}: counted {stats.num_tokens} tokens, {stats.rank_tokens}")
    if stats.tokens_per_expert != layer.last_stats.tokens_per_expert:
        failures.append(f"rank {rank}: counts {stats.tokens_per_expert} vs {layer.last_stats.tokens_per_expert}")
    if stats.cross_node_rows != layer.last_stats.cross_node_rows and layer.last_stats.plan.token_exchange == "ragged":
        failures.append(f"rank {rank}: cross-node rows {stats.cross_node_rows}")
    if not torch.allclose(direct, capacity_path, rtol=0, atol=1e-6):
        failures.append(f"rank {rank}: differs from the capacity path by {(direct - capacity_path).abs().max()}")
    if not torch.allclose(direct, expected, rtol=1e-5, atol=1e-6):
        failures.append(f"rank {rank}: differs from the reference by {(direct - expected).abs().max()}")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_the_direct_exchange_equals_the_capacity_path_and_the_reference(world_size: int, case: str) -> None:
    tokens = (1, 5, 0, 3)[:world_size] if world_size == 4 else (1, 6)  # uneven, one rank with none
    results = run_distributed(_equivalence, world_size, CASES[case], tokens, timeout_s=180, collective_timeout_s=60)
    assert [failure for failures in results for failure in failures] == []


def _kept_capacity_path(rank: int, world_size: int) -> list[str]:
    """Too many rows on one rank, or a capacity that drops: every rank keeps the capacity path."""
    failures = []
    for settings, tokens in (({"top_k": 2, "capacity_factor": 0.0}, DIRECT_EXCHANGE_ROWS if rank == 0 else 1),
                             ({"top_k": 2, "capacity_factor": 0.5}, 40)):
        layer, reference = _pair(world_size, settings)
        x = torch.randn(tokens, M, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            y = layer(x)
            if layer.last_stats.plan.source == SOURCE:
                failures.append(f"rank {rank}: {settings} took the direct exchange")
            if settings["capacity_factor"] == 0.0 and not torch.allclose(y, reference(x), rtol=1e-5, atol=1e-6):
                failures.append(f"rank {rank}: differs from the reference")
    return failures


@pytest.mark.distributed
def test_a_large_or_dropping_forward_keeps_the_capacity_path() -> None:
    results = run_distributed(_kept_capacity_path, 2, timeout_s=180, collective_timeout_s=60)
    assert [failure for failures in results for failure in failures] == []


def _ops_of_one_token(rank: int, world_size: int) -> tuple[int, int]:
    layer, _ = _pair(world_size, {"top_k": 2, "capacity_factor": 0.0, "activation": "swiglu", "bias": False,
                                  "aux_loss_weight": 0.0})
    x = torch.randn(1, M)
    with torch.no_grad():
        layer(x)
        with OpCount() as count:
            layer(x)
    return sum(count.counts.values()), count.counts["aten.mm"]


@pytest.mark.distributed
def test_one_token_on_two_workers_runs_few_ops() -> None:
    """The capacity path ran about 180 ops per forward on 2 workers at one token; the direct exchange
    runs the gate's and the picked experts' GEMMs and a few dozen others."""
    for ops, gemms in run_distributed(_ops_of_one_token, 2, timeout_s=120, collective_timeout_s=60):
        assert gemms <= 1 + 2 * 3 and ops <= 80, (ops, gemms)
