"""The expert-parallel direct paths: a small no-grad forward sends each choice's row straight to its
expert's rank and back (moeflow.direct_exchange), and a tiny one's tokens ride the load all-gather
(moeflow.direct_gather), with no capacity buffer. On 2 and 4 gloo processes both compute what the
capacity path and the reference compute, every rank decides alike (uneven and empty ranks
included), and each is taken only where it may be."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.core.stats import RoutingStats
from moeflow.parallel.agreement import GATHER_TOKENS
from moeflow.parallel.dispatchers.rows import DIRECT_EXCHANGE_ROWS
from moeflow.parallel.dispatchers.stats import GATHERED, SOURCE
from moeflow.reference import ReferenceMoE
from op_count import OpCount
from pool import run_distributed

M, H, E = 16, 24, 8

CASES = {
    "k2-gelu": {"top_k": 2, "capacity_factor": 0.0},
    "k3-swiglu-shared": {"top_k": 3, "capacity_factor": 0.0, "activation": "swiglu", "bias": False,
                         "num_shared_experts": 1},
    "k2-relu-f4": {"top_k": 2, "capacity_factor": 4.0, "activation": "relu"},  # C >= T: drops nothing
}


def _failures(fn: Any, world_size: int, *args: Any) -> list[str]:
    """Every rank's failures of ``fn`` (each returns a list of them), one list."""
    results = run_distributed(fn, world_size, *args, timeout_s=180, collective_timeout_s=60)
    return [failure for failures in results for failure in failures]


def _pair(world_size: int, settings: dict) -> tuple[MoELayer, ReferenceMoE]:
    torch.manual_seed(0)
    reference_settings = {k: v for k, v in settings.items() if k in inspect.signature(ReferenceMoE).parameters}
    reference = ReferenceMoE(M, H, E, **reference_settings)
    groups = ParallelGroups(torch.distributed.group.WORLD, Topology(world_size, 2 if world_size > 2 else 1))
    layer = MoELayer(M, H, E, parallel="expert", group=groups, **settings)
    layer.load_full_state_dict(reference.state_dict())
    return layer, reference


def _equivalence(rank: int, world_size: int, settings: dict, tokens: tuple[int, ...]) -> list[str]:
    """Three no-grad forwards: the first gathers the load alone (its bucket is empty) and exchanges
    the rows; the next two carry their tokens in the gather. Then each against the capacity path
    (a grad forward, which also empties the bucket)."""
    layer, reference = _pair(world_size, settings)
    xs = [torch.randn(tokens[rank], M, generator=torch.Generator().manual_seed(rank + 7 * step)) for step in range(3)]
    with torch.no_grad():
        directs = [(layer(x), layer.last_stats, reference(x)) for x in xs]
    failures = []
    for step, (x, (direct, stats, expected), exchange) in enumerate(zip(xs, directs, ("ragged", GATHERED, GATHERED),
                                                                        strict=True)):
        capacity_path = layer(x).detach()  # grad enabled: the capacity path
        failures += [f"step {step} rank {rank}: {failure}" for failure in _differences(
            layer, stats, exchange, tokens, direct, capacity_path, expected, tokens[rank])]
    return failures


def _differences(
    layer: MoELayer, stats: RoutingStats, exchange: str, tokens: tuple[int, ...], direct: torch.Tensor,
    capacity_path: torch.Tensor, expected: torch.Tensor, mine: int,
) -> list[str]:
    failures = []
    if stats.plan.source != SOURCE or layer.last_stats.plan.source == SOURCE:
        failures.append(f"sources {stats.plan.source}, {layer.last_stats.plan.source}")
    if stats.plan.world_size != layer.world_size or stats.plan.token_exchange != exchange or stats.dropped:
        failures.append(f"stats {stats.plan}, expected the {exchange} exchange")
    if not 0 < stats.timing.expert_forward_s < stats.timing.forward_s and mine:
        failures.append(f"timing {stats.timing}")
    if stats.num_tokens != sum(tokens) or sum(stats.rank_tokens) != sum(tokens) * layer.config.top_k:
        failures.append(f"counted {stats.num_tokens} tokens, {stats.rank_tokens}")
    if stats.tokens_per_expert != layer.last_stats.tokens_per_expert:
        failures.append(f"counts {stats.tokens_per_expert} vs {layer.last_stats.tokens_per_expert}")
    if exchange == "ragged" and stats.cross_node_rows != layer.last_stats.cross_node_rows:
        failures.append(f"cross-node rows {stats.cross_node_rows} vs {layer.last_stats.cross_node_rows}")
    if not torch.allclose(direct, capacity_path, rtol=0, atol=1e-6):
        failures.append(f"differs from the capacity path by {(direct - capacity_path).abs().max()}")
    if not torch.allclose(direct, expected, rtol=1e-5, atol=1e-6):
        failures.append(f"differs from the reference by {(direct - expected).abs().max()}")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_the_direct_paths_equal_the_capacity_path_and_the_reference(world_size: int, case: str) -> None:
    tokens = (1, 5, 0, 3) if world_size == 4 else (1, 6)  # uneven, one rank with none
    assert _failures(_equivalence, world_size, CASES[case], tokens) == []


def _bf16(rank: int, world_size: int) -> list[str]:
    layer, _ = _pair(world_size, {"top_k": 3, "capacity_factor": 0.0, "activation": "swiglu", "bias": False})
    xs = [torch.randn(4, M, generator=torch.Generator().manual_seed(rank + 7 * step)).bfloat16() for step in range(2)]
    with torch.no_grad():
        directs = [(layer(x), layer.last_stats.plan.token_exchange) for x in xs]
    failures = []
    for x, (direct, exchange), expected in zip(xs, directs, ("ragged", GATHERED), strict=True):
        difference = (direct.float() - layer(x).detach().float()).abs().max()
        if exchange != expected or direct.dtype != torch.bfloat16 or difference > 2e-2:
            failures.append(f"rank {rank}: {exchange}, {direct.dtype}, differs by {difference}")
    return failures


@pytest.mark.distributed
def test_the_direct_paths_in_bf16_match_the_capacity_path() -> None:
    assert _failures(_bf16, 2) == []


def _bucket_changes(rank: int, world_size: int) -> list[tuple[str, int | None]]:
    """Token counts that outgrow the bucket, or any gather: every rank takes the same path each forward."""
    layer, reference = _pair(world_size, {"top_k": 2, "capacity_factor": 0.0})
    seen = []
    for step, count in enumerate((2, 2, 3 if rank == 0 else 1, 3, GATHER_TOKENS + 1, GATHER_TOKENS + 1)):
        x = torch.randn(count, M, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            y = layer(x)
            if not torch.allclose(y, reference(x), rtol=1e-5, atol=1e-6):
                return [("differs", step)]
        seen.append((layer.last_stats.plan.token_exchange, layer.last_stats.cross_node_rows))
    return seen


@pytest.mark.distributed
def test_a_rank_outgrowing_the_bucket_sends_every_rank_to_the_exchange() -> None:
    first, second = run_distributed(_bucket_changes, 2, timeout_s=120, collective_timeout_s=60)
    assert first == second
    # bucket 0, then 2; rank 0's 3 tokens outgrow it (the exchange), then the bucket is 3; 9 tokens
    # never fit: exchanged (and the bucket is emptied)
    assert [exchange for exchange, _ in first] == ["ragged", GATHERED, "ragged", GATHERED, "ragged", "ragged"]
    assert first[1][1] == 2 + 2  # a node each: every gathered token crosses once


def _one_rank_with_grad(rank: int, world_size: int) -> tuple[str, bool]:
    layer, reference = _pair(world_size, {"top_k": 2, "capacity_factor": 0.0})
    with torch.no_grad():
        layer(torch.randn(2, M))  # the next gather carries tokens
    x = torch.randn(2, M, generator=torch.Generator().manual_seed(rank))
    with torch.set_grad_enabled(rank == 0):  # as a worker joining with empty batches outside no_grad did
        y = layer(x)
    return layer.last_stats.plan.source, torch.allclose(y.detach(), reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_ranks_that_differ_in_grad_mode_agree_on_the_capacity_path() -> None:
    """Grad mode is each rank's own: the ranks agree on the path in the load all-gather, so one rank
    with grad sends every rank to the capacity path rather than into different collectives."""
    results = run_distributed(_one_rank_with_grad, 2, timeout_s=120, collective_timeout_s=30)
    assert all(source != SOURCE and equal for source, equal in results), results


def _gathered_cross_node_rows(rank: int, world_size: int) -> int | None:
    layer, _ = _pair(world_size, {"top_k": 2, "capacity_factor": 0.0})  # 2 nodes of 2 ranks
    with torch.no_grad():
        for _ in range(2):
            layer(torch.randn(rank + 1, M))
    return layer.last_stats.cross_node_rows if layer.last_stats.plan.token_exchange == GATHERED else None


@pytest.mark.distributed
def test_gathered_tokens_count_the_rows_sent_to_the_other_node() -> None:
    # ranks 0, 1 on node 0 with 1 and 2 tokens, ranks 2, 3 on node 1 with 3 and 4: each token goes
    # to the two ranks of the other node
    assert run_distributed(_gathered_cross_node_rows, 4, timeout_s=120) == [2 * (1 + 2 + 3 + 4)] * 4


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
    assert _failures(_kept_capacity_path, 2) == []


def _ops_of_one_token(rank: int, world_size: int) -> tuple[int, int, int, str]:
    layer, _ = _pair(world_size, {"top_k": 2, "capacity_factor": 0.0, "activation": "swiglu", "bias": False,
                                  "aux_loss_weight": 0.0})
    x = torch.randn(1, M)
    with torch.no_grad():
        layer(x)
        with OpCount() as count:
            layer(x)
    collectives = sum(n for op, n in count.counts.items() if op.startswith("c10d."))
    return sum(count.counts.values()), count.counts["aten.mm"], collectives, layer.last_stats.plan.token_exchange


@pytest.mark.distributed
def test_one_token_on_two_workers_runs_few_ops_and_two_collectives() -> None:
    """The capacity path ran about 180 ops and three collectives per forward on 2 workers at one
    token; gathered, a forward runs the gate's and the picked experts' GEMMs, a few dozen other ops,
    the load all-gather (with the token) and one all-to-all back."""
    for ops, gemms, collectives, exchange in run_distributed(_ops_of_one_token, 2, timeout_s=120):
        assert exchange == GATHERED and collectives == 2, (exchange, collectives)
        assert gemms <= 1 + 2 * 3 and ops <= 100, (ops, gemms)
