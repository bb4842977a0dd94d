"""The ragged token exchange sends only the kept rows and lands them where the padded exchange does:
its routes on one process, its chunks against the padded exchange on 2 and 4 gloo processes with
each algorithm, and the bytes a layer sends (the layer's outputs and gradients are in the
equivalence table)."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.parallel.chunk_pipeline import ExpertExchange
from moeflow.parallel.ragged_exchange import RaggedExpertExchange, chunk_saving, ragged_routes
from pool import run_distributed


def test_routes_of_a_chunk() -> None:
    # 2 ranks, 2 experts each; the chunk holds slots [1, 3) of a capacity of 3
    filled_WE = torch.tensor([[3, 0, 1, 2], [2, 1, 0, 3]])
    routes = ragged_routes(filled_WE, rank=1, start=1, slots=2)
    # rank 1 sends expert 0's slots 1-2 (rows 0, 1 of the chunk: 1 row, slot 1), expert 3's slots 1-2
    assert routes.sent_N.tolist() == [0, 6, 7]
    assert routes.matrix == [[2, 1], [1, 2]]
    # it receives experts 2, 3 (local 0, 1) in the (l, s, j) layout of 2 x 2 x 2, read by source
    # source 0: expert 3 slot 1 -> (1, 0, 0) = 4; source 1: expert 3 slots 1, 2 -> (1, 1, 0..1) = 6, 7
    assert routes.received_N.tolist() == [4, 6, 7]
    assert chunk_saving(filled_WE, start=1, slots=2) == 1 - 6 / 16


def test_a_nearly_full_chunk_travels_padded() -> None:
    groups = ParallelGroups.single_process()
    full = RaggedExpertExchange(groups, "linear", torch.full((1, 2), 10), min_saving=0.1)
    assert full._routes(10) is None
    assert full.chunk(5, 10)._routes(5) is None
    half = RaggedExpertExchange(groups, "linear", torch.tensor([[10, 4]]), min_saving=0.1)
    routes = half._routes(10)
    assert routes is not None and chunk_saving(half.filled_WE, 0, 10) == pytest.approx(0.3)
    # derived once per forward: the chunk's combine and backward find the dispatch's routes
    assert half.chunk(0, 10)._routes(10) is routes and set(half.routes) == {(0, 10)}


def _layout_check(rank: int, world_size: int) -> list[str]:
    algorithms = ("linear", "2dh", "pairwise")
    return [failure for algorithm in algorithms for failure in _layout_of(rank, world_size, algorithm)]


def _layout_of(rank: int, world_size: int, algorithm: str) -> list[str]:
    groups = ParallelGroups(torch.distributed.group.WORLD, Topology(world_size, 2 if world_size > 2 else 1))
    experts, capacity, model_dim = 2 * world_size, 5, 3
    generator = torch.Generator().manual_seed(3)
    filled_WE = torch.randint(0, capacity + 1, (world_size, experts), generator=generator)
    buffer_ECM = torch.randn(world_size, experts, capacity, model_dim, generator=generator)[rank]
    keep = torch.arange(capacity) < filled_WE[rank].unsqueeze(1)
    buffer_ECM = buffer_ECM * keep.unsqueeze(-1)  # tokens fill the first slots; the rest is zero
    padded = ExpertExchange(groups, algorithm, experts // world_size)
    ragged = RaggedExpertExchange(groups, algorithm, filled_WE, min_saving=0.0)
    failures = []
    for start, stop in ((0, 2), (2, 5)):
        chunk = buffer_ECM[:, start:stop]
        expected = padded.to_experts(chunk)
        received = ragged.chunk(start, stop).to_experts(chunk)
        if not torch.equal(received, expected):
            failures.append(f"{algorithm} rank {rank} dispatch of [{start}, {stop})")
        back = ragged.chunk(start, stop).from_experts(expected * 2, stop - start)
        if not torch.equal(back, padded.from_experts(expected * 2, stop - start)):
            failures.append(f"{algorithm} rank {rank} combine of [{start}, {stop})")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_ragged_chunks_land_where_the_padded_ones_do(world_size: int) -> None:
    results = run_distributed(_layout_check, world_size, timeout_s=120, collective_timeout_s=60)
    assert [failure for rank_failures in results for failure in rank_failures] == []


def _sent_bytes(rank: int, world_size: int, token_exchange: str) -> tuple[int, int, str, int | None, int]:
    torch.manual_seed(0)
    groups = ParallelGroups(torch.distributed.group.WORLD, Topology(world_size, 1))  # a node each
    layer = MoELayer(16, 32, 4, top_k=1, capacity_factor=0.0, parallel="expert", pipeline=2,
                     token_exchange=token_exchange, group=groups)
    x = torch.randn(40, 16)
    x[:, 0] += 30.0 * torch.arange(40).lt(30)  # a skewed load: most tokens pick one expert
    entered: list[int] = []
    groups.ledger.on_enter = lambda entry: entered.append(entry.nbytes if entry.operation == "all-to-all" else 0)
    layer(x).sum().backward()
    sent = sum(entered)
    stats = layer.last_stats
    return sent, sum(stats.tokens_per_expert), stats.plan.token_exchange, stats.cross_node_rows, stats.capacity


@pytest.mark.distributed
def test_a_ragged_layer_sends_only_its_kept_rows() -> None:
    padded = run_distributed(_sent_bytes, 2, "padded", timeout_s=120)
    ragged = run_distributed(_sent_bytes, 2, "ragged", timeout_s=120)
    assert [result[2] for result in ragged] == ["ragged", "ragged"]
    kept = ragged[0][1]
    # forward dispatch and combine, backward the same: each kept row crosses 4 times, 16 fp32 each
    assert sum(result[0] for result in ragged) == 4 * kept * 16 * 4
    assert sum(result[0] for result in padded) > 1.5 * sum(result[0] for result in ragged)
    # between the two nodes: all of the other rank's 2 experts' slots padded, fewer rows ragged
    assert padded[0][3] == 2 * 2 * padded[0][4]
    assert 0 < ragged[0][3] < padded[0][3]


def test_cross_node_rows_count_the_rows_for_other_nodes() -> None:
    from moeflow.comm.topology import cross_node_rows

    filled_WE = torch.tensor([[5, 1, 2, 0], [0, 3, 1, 1], [2, 2, 2, 2], [9, 0, 0, 4]])  # one expert per rank
    topology = Topology(4, 2)  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert cross_node_rows(filled_WE, 3, True, topology) == (2 + 0) + (1 + 1) + (2 + 2) + (3 + 0)
    assert cross_node_rows(filled_WE, 3, False, topology) == 4 * 2 * 3


def test_the_planner_prices_a_ragged_plan_by_its_kept_rows() -> None:
    from moeflow.config import LayerDims
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
    from moeflow.perf.schedule_models import ExpertParallelModel, Plan
    from moeflow.perf.shape import RegionShape

    profile = ClusterProfile(nodes=2, ranks_per_node=1, fits={
        "alltoall.linear": AlphaBeta(1e-4, 1e-8), "alltoall.pairwise": AlphaBeta(1e-4, 1e-8),
        "gemm": AlphaBeta(1e-5, 1e-11)})
    cost = CostModel(profile)
    # dropless under skew: capacity 400 slots per expert for 2 x 100 / 8 = 25 kept rows on average
    shape = RegionShape(LayerDims(64, 128, 8, 2), 2, 400, 4, tokens=100)
    padded, ragged, auto = (ExpertParallelModel(exchange=e).predict(Plan("expert", 1, "linear", exchange=e), cost,
                                                                     shape, True) for e in ("padded", "ragged", "auto"))
    assert ragged.total_s < padded.total_s / 4 and auto.total_s == ragged.total_s
    automatic = ExpertParallelModel(exchange="auto")
    assert {plan.exchange for plan in automatic.candidates(shape, (1, 2), ("linear",))} == {"auto"}
    assert automatic.forced_plan(2, "linear") == Plan("expert", 2, "linear", exchange="auto")
    forced = ExpertParallelModel(exchange="ragged")  # the smart schedule's steps send padded slots
    assert all(plan.schedule != "smart" for plan in forced.candidates(shape, (1,), ("pairwise",)))
    assert any(plan.schedule == "smart" for plan in automatic.candidates(shape, (1,), ("pairwise",)))


def test_a_tokens_copies_sum_in_fp32_and_round_once_without_atomic_adds() -> None:
    """The dedup combines' sum: bf16 copies added in fp32 and rounded once, in an order fixed by
    the routes. ``index_add_`` is atomic on CUDA (its adds land in the order its threads do, and
    in bf16 each rounds), so a bf16 step changed from run to run there; CPU's happens to add in
    fp32, so what this machine can check is that no ``index_add`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moeflow.parallel.ragged_exchange import summed_rows

    class Operators(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    rows = torch.tensor([1.0, 2**-9, 2**-9, 2**-9, 2**-9, 3.0], dtype=torch.bfloat16).unsqueeze(1).repeat(1, 3)
    into = torch.tensor([0, 0, 0, 0, 0, 1])
    with Operators() as operators:
        summed = summed_rows(rows, into, 3)
    assert not any("index_add" in name for name in operators.seen), operators.seen
    expected = torch.zeros(3, 3).index_add_(0, into, rows.float()).to(torch.bfloat16)
    assert summed.dtype == torch.bfloat16 and torch.equal(summed, expected)
    assert float(summed[0, 0]) == 1 + 2**-7 and float(summed[2, 0]) == 0.0
