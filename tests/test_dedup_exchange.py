"""The dedup token exchange (``token_exchange='dedup'``, a token crosses to each rank once): the rows
it saves against an independent count of the routing, the bytes a training step sends against the
ragged exchange on 2 and 4 gloo processes, the expected share the planner and the simulator price,
and the records' checks. (Outputs and gradients equal to the reference: the equivalence table.)"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.config import MoEConfig, dedup_row_share
from moeflow.core.routing.router import route
from moeflow.parallel.dedup_exchange import TOKEN_INDEX_BYTES
from pool import run_distributed

MODEL_DIM = 16


def _step(
    rank: int, world_size: int, token_exchange: str, experts: int, degree: int, tokens: int = 40
) -> dict[str, int]:
    """One dropless training step of a k = 2 layer: this rank's all-to-all bytes, the layer's saved
    rows and bytes, the rows its routing sends twice to one rank (counted from the choices), and
    the kept rows of all ranks."""
    torch.manual_seed(0)
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, 2 if world_size > 2 else 1))
    layer = MoELayer(MODEL_DIM, 32, experts, top_k=2, capacity_factor=0.0, group=groups,
                     token_exchange=token_exchange, pipeline=degree, parallel="expert")
    sent: list[int] = []
    groups.ledger.on_enter = lambda entry: sent.append(entry.nbytes if "all-to-all" in entry.operation else 0)
    torch.manual_seed(10 + rank)
    x = torch.randn(tokens, MODEL_DIM, requires_grad=True)
    layer(x).sum().backward()
    groups.ledger.on_enter = None
    stats = layer.last_stats
    with torch.no_grad():
        rank_of_TK = route(layer.gate, x, 2, layer.config).choice.expert_idx_TK // (experts // world_size)
    repeated = torch.tensor([int((rank_of_TK[:, 0] == rank_of_TK[:, 1]).sum())])
    dist.all_reduce(repeated)
    return {"bytes": sum(sent), "saved_rows": stats.dedup_saved_rows or 0, "saved_bytes": stats.dedup_saved_bytes or 0,
            "repeated": int(repeated), "kept": sum(stats.tokens_per_expert) - stats.dropped}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_token_crosses_to_each_rank_once(world_size: int) -> None:
    """At degree 1 the rows saved are exactly the tokens whose two choices share a rank, and a
    training step sends that many rows fewer in each of its four all-to-alls, paying 4 bytes a kept
    row for the token indices, for the gate weights (fp32) and for their gradients."""
    experts = 4 * world_size
    ragged = run_distributed(_step, world_size, "ragged", experts, 1)
    dedup = run_distributed(_step, world_size, "dedup", experts, 1)
    saved_rows = dedup[0]["saved_rows"]
    assert saved_rows == dedup[0]["repeated"] > 0
    assert dedup[0]["saved_bytes"] == 2 * saved_rows * MODEL_DIM * 4  # the forward's dispatch and combine
    kept = dedup[0]["kept"]
    sent_ragged, sent_dedup = (sum(rank["bytes"] for rank in run) for run in (ragged, dedup))
    assert sent_ragged - sent_dedup == 2 * dedup[0]["saved_bytes"] - kept * (TOKEN_INDEX_BYTES + 4 + 4)
    assert all(rank["saved_rows"] == saved_rows for rank in dedup)  # every rank reports the global count


@pytest.mark.distributed
def test_pipelined_chunks_keep_most_of_the_saving() -> None:
    """In capacity chunks a token's copies in two chunks travel twice; a dropless call fills a
    token's slots together (token-major), so at degree 4 most copies share a chunk (choice-major,
    GShard's order, the second choices sit after every first one: nearly none did)."""
    whole = run_distributed(_step, 2, "dedup", 8, 1, 512)[0]["saved_rows"]
    chunked = run_distributed(_step, 2, "dedup", 8, 4, 512)[0]["saved_rows"]
    assert 0.6 * whole <= chunked <= whole


@pytest.mark.distributed
def test_one_expert_per_rank_saves_nothing() -> None:
    assert run_distributed(_step, 2, "dedup", 2, 1)[0]["saved_rows"] == 0


@pytest.mark.parametrize(("experts", "world", "top_k"), [(8, 2, 2), (32, 2, 2), (8, 4, 2), (16, 4, 3), (6, 2, 1)])
def test_the_expected_share_counts_the_ranks_a_tokens_choices_reach(experts: int, world: int, top_k: int) -> None:
    """The formula against every choice of k distinct experts, counted."""
    local = experts // world
    ranks = [len({e // local for e in choice}) for choice in itertools.combinations(range(experts), top_k)]
    assert dedup_row_share(experts, world, top_k) == pytest.approx(sum(ranks) / len(ranks) / top_k)
    assert dedup_row_share(experts, world, top_k) == pytest.approx(1.0) or experts > world


def test_one_expert_per_rank_shares_nothing() -> None:
    assert dedup_row_share(4, 4, 2) == 1.0
    assert dedup_row_share(8, 2, 2) == pytest.approx(1 - math.comb(4, 2) / math.comb(8, 2))


def test_the_planner_prices_a_dedup_dispatch() -> None:
    """The layer's planner: the same plan is cheaper with dedup when a rank holds several experts."""
    from moeflow.config import LayerDims
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
    from moeflow.perf.schedule_models import ExpertParallelModel, Plan
    from moeflow.perf.shape import RegionShape

    profile = ClusterProfile(nodes=2, ranks_per_node=1,
                             fits={"alltoall.linear": AlphaBeta(1e-4, 1e-8), "gemm": AlphaBeta(1e-5, 1e-11)})
    cost = CostModel(profile)

    def seconds(exchange: str, experts: int) -> float:
        shape = RegionShape.for_tokens(LayerDims(512, 1024, experts, top_k=2), 2048, world_size=2)
        model = ExpertParallelModel(exchange=exchange)
        return model.predict(Plan("expert", 1, "linear", exchange=exchange), cost, shape, True).total_s

    assert seconds("dedup", 8) < seconds("ragged", 8)
    assert seconds("dedup", 2) == pytest.approx(seconds("ragged", 2))


def test_the_simulator_sends_the_share_both_ways() -> None:
    """Every all-to-all of the layer's step sends the share of its rows; under 2DH the phase between
    nodes sends one row per (token, node)."""
    from moeflow.config import LayerDims
    from moeflow.sim import ModelSpec, StepPlan, load_cluster, simulate_step

    cluster = load_cluster("fastermoe-johnny")
    experts = 4 * cluster.world_size
    model = ModelSpec(layers=1, dims=LayerDims(1024, 2048, experts, top_k=4, bias=False), dtype="fp32",
                      tokens_per_rank=4096, capacity_factor=0.0)

    def busy(top_k: int | None, algorithm: str = "linear") -> float:
        plan = StepPlan(ragged_exchange=True, dedup_top_k=top_k, algorithm=algorithm)
        return simulate_step(cluster, model, plan, layer_only=True).busy_s["alltoall"]

    share = dedup_row_share(experts, cluster.world_size, 4)
    assert busy(4) == pytest.approx(busy(None) * share, rel=0.05)  # start-ups aside
    assert busy(4, "2dh") < busy(None, "2dh") * share  # fewer rows cross between nodes than reach ranks
    with pytest.raises(ValueError, match="dedup_top_k must be an integer"):
        StepPlan(dedup_top_k=2)  # a padded exchange sends every slot


def test_dedup_refuses_what_hands_it_other_buffers() -> None:
    from moeflow.parallel.registry import check_techniques

    with pytest.raises(ValueError, match=r"token_exchange='dedup'.*shadowing"):
        check_techniques(MoEConfig(16, 32, 4, token_exchange="dedup", shadowing="auto"), "expert")
    check_techniques(MoEConfig(16, 32, 4, token_exchange="dedup"), "expert")


def test_auto_prices_dedup_where_its_record_allows_it() -> None:
    """token_exchange='auto' (the default) adds each plan as a dedup plan where a cost model prices
    it and a token's choices share ranks; not without a profile, not at one expert per rank, and
    not beside the wrappers whose records refuse dedup."""
    from moeflow.config import LayerDims
    from moeflow.parallel.registry import dedup_allowed
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
    from moeflow.perf.schedule_models import ExpertParallelModel
    from moeflow.perf.shape import RegionShape

    cost = CostModel(ClusterProfile(nodes=2, ranks_per_node=1, fits={
        "alltoall.linear": AlphaBeta(1e-4, 1e-8), "gemm": AlphaBeta(1e-5, 1e-11)}))
    model = ExpertParallelModel(exchange="auto", dedup_candidate=True)

    def exchanges(experts: int, priced: CostModel | None, candidate: ExpertParallelModel = model) -> set[str]:
        shape = RegionShape.for_tokens(LayerDims(64, 128, experts, top_k=2), 256, world_size=2)
        return {plan.exchange for plan in candidate.candidates(shape, (1, 2), ("linear",), priced)}

    assert exchanges(8, cost) == {"auto", "dedup"}
    assert exchanges(8, None) == {"auto"}  # unpriced: the search times no dedup plan
    assert exchanges(2, cost) == {"auto"}  # one expert per rank: nothing to save
    assert exchanges(8, cost, ExpertParallelModel(exchange="auto")) == {"auto"}
    assert dedup_allowed(MoEConfig(16, 32, 4))
    for refusing in ({"shadowing": "auto"}, {"redundant_experts": 2}, {"balance": "auto", "redundant_experts": 2}):
        assert not dedup_allowed(MoEConfig(16, 32, 4, **refusing)), refusing


def _auto_with_dedup(rank: int, world_size: int) -> dict[str, object]:
    """A layer on defaults with a profile whose links make dedup the model's pick: its search times
    dedup plans, and whatever it settles on computes the padded layer's function."""
    from moeflow.perf import AlphaBeta, ClusterProfile

    profile = ClusterProfile(nodes=2, ranks_per_node=1, fits={
        "alltoall.linear": AlphaBeta(1e-4, 1e-6), "gemm": AlphaBeta(1e-6, 1e-12)})
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, 1))
    torch.manual_seed(0)
    layer = MoELayer(MODEL_DIM, 32, 8, top_k=2, capacity_factor=0.0, group=groups, profile=profile)
    torch.manual_seed(0)
    padded = MoELayer(MODEL_DIM, 32, 8, top_k=2, capacity_factor=0.0, group=groups, token_exchange="padded",
                      pipeline=1)
    exchanges, equal = [], True
    for step in range(11):
        x = torch.randn(40, MODEL_DIM, generator=torch.Generator().manual_seed(100 * rank + step))
        y = layer(x.clone().requires_grad_())
        y.sum().backward()
        exchanges.append(layer.last_stats.plan.token_exchange)
        equal &= torch.allclose(y.detach(), padded(x).detach(), rtol=1e-5, atol=1e-6)
        layer.zero_grad(set_to_none=True)
    return {"exchanges": exchanges, "equal": bool(equal), "source": layer.last_stats.plan.source}


@pytest.mark.distributed
def test_the_default_exchange_times_dedup_when_the_profile_prices_it_first() -> None:
    results = run_distributed(_auto_with_dedup, 2, timeout_s=120)
    first = results[0]
    assert "dedup" in first["exchanges"][1:9] and first["source"] == "settled"
    assert all(result["equal"] for result in results) and results[0]["exchanges"] == results[1]["exchanges"]


def _crossings(rank: int, world_size: int, algorithm: str) -> dict[str, int]:
    """One dropless training step on 2 nodes of 2 ranks: the layer's cross-node rows and saved rows,
    and both counted from the routing (distinct (token, node) and (token, rank) pairs off this
    rank's node; choices that share a rank)."""
    torch.manual_seed(0)
    topology = Topology(world_size, 2)
    groups = ParallelGroups(dist.group.WORLD, topology)
    experts = 16
    layer = MoELayer(MODEL_DIM, 32, experts, top_k=3, capacity_factor=0.0, group=groups, token_exchange="dedup",
                     alltoall=algorithm, pipeline=1, parallel="expert")
    torch.manual_seed(10 + rank)
    x = torch.randn(40, MODEL_DIM, requires_grad=True)
    layer(x).sum().backward()
    with torch.no_grad():
        rank_of_TK = route(layer.gate, x, 3, layer.config).choice.expert_idx_TK // (experts // world_size)
    node_of_TK = rank_of_TK // 2
    me = topology.node_of(rank)
    counts = torch.tensor([
        sum(len(set(row.tolist()) - {me}) for row in node_of_TK),  # (token, other node) pairs
        sum(len({r for r in row.tolist() if topology.node_of(r) != me}) for row in rank_of_TK),  # off-node ranks
        sum(3 - len(set(row.tolist())) for row in rank_of_TK),  # choices that share a rank
    ])
    dist.all_reduce(counts)
    waited = not callable(layer._last.stats)  # node dedup's totals: an all-reduce the forward did not wait for
    stats = layer.last_stats
    return {"crossed": stats.cross_node_rows, "saved": stats.dedup_saved_rows, "node_pairs": int(counts[0]),
            "rank_pairs": int(counts[1]), "repeated": int(counts[2]), "waited": waited}


@pytest.mark.distributed
def test_under_2dh_a_token_crosses_to_each_node_once() -> None:
    """Under the 2DH all-to-all the rows between nodes are the (token, node) pairs, fewer than the
    (token, rank) pairs the rank-level exchange sends across; both save the same rows per rank."""
    node_level = run_distributed(_crossings, 4, "2dh")[0]
    rank_level = run_distributed(_crossings, 4, "linear")[0]
    assert node_level["crossed"] == node_level["node_pairs"] < rank_level["crossed"] == rank_level["rank_pairs"]
    assert node_level["saved"] == rank_level["saved"] == node_level["repeated"] > 0
    assert not node_level["waited"]  # the statistics are read when asked, not in the forward


def test_the_benchmarks_summary_sets_ratios_side_by_side() -> None:
    from moeflow.bench.dedup import summarize

    record = {"bench": "dedup", "config": "E8", "experts_per_rank": 4, "dispatch_rows_over_dedup": 1.26,
              "predicted_rows_over_dedup": 1.27, "step_bytes_over_dedup": 1.25, "cross_node_rows_ragged": 100,
              "cross_node_rows_dedup": 80, "train_step_over_dedup": 1.09}
    summary = summarize([record, {"bench": "speed-probe"}])
    assert summary["configs"] == 1
    assert summary["dispatch_rows_over_dedup"] == {"E8 E/W=4": 1.26}
    assert summary["cross_node_rows_over_dedup"] == {"E8 E/W=4": 1.25}
    assert summarize([]) == {"summary": "dedup", "configs": 0}


def _one_rank_disagrees(rank: int, world_size: int) -> str:
    """Rank 1 derives one row too many from rank 0 (a bug in one rank's routes): every rank must
    fail at the sizes' all-gather with the same words, none wait in the next all-to-all."""
    import moeflow.parallel.dedup_exchange as dedup

    if rank == 1:
        derive = dedup._receiver_side

        def one_too_many(tokens_N: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
            copies, sizes = derive(tokens_N, counts)
            return copies, [sizes[0] + 1, *sizes[1:]]

        dedup._receiver_side = one_too_many  # this worker's own module: the job ends the pool after it
    torch.manual_seed(0)
    layer = MoELayer(MODEL_DIM, 32, 8, top_k=2, capacity_factor=0.0, token_exchange="dedup", parallel="expert")
    try:
        layer(torch.randn(24, MODEL_DIM))
    except RuntimeError as error:
        return str(error)
    finally:
        if rank == 1:
            dedup._receiver_side = derive
    return "no error"


@pytest.mark.distributed
def test_a_check_that_fails_on_one_rank_fails_on_every_rank_at_once() -> None:
    messages = run_distributed(_one_rank_disagrees, 2, collective_timeout_s=20.0)
    assert messages[0] == messages[1]
    assert messages[0].startswith("dedup exchange: rank 1 expects") and "from rank 0" in messages[0]


def _bf16_step(rank: int, world_size: int, alltoall: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One bf16 training step of a k = 8 dedup layer (E 8): its output and the input's gradient."""
    torch.manual_seed(0)
    groups = ParallelGroups(dist.group.WORLD, Topology(world_size, 2))
    layer = MoELayer(MODEL_DIM, 32, 8, top_k=8, capacity_factor=0.0, group=groups, token_exchange="dedup",
                     alltoall=alltoall, parallel="expert").to(torch.bfloat16)
    torch.manual_seed(5 + rank)
    x = (torch.rand(32, MODEL_DIM) * 0.8).to(torch.bfloat16).requires_grad_()
    y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "alltoall"), [(2, "linear"), (4, "2dh")])
def test_a_bf16_dedup_step_gives_the_same_bits_twice(world_size: int, alltoall: str) -> None:
    """The dedup and node-dedup combines sum a token's copies in a fixed order. On CPU this held
    before too; on CUDA the fixed order replaces index_add_'s atomic adds, which no several-rank
    GPU run here can show (tests/test_ragged_exchange.py checks that none runs)."""
    first = run_distributed(_bf16_step, world_size, alltoall)
    second = run_distributed(_bf16_step, world_size, alltoall)
    for (y, grad), (y_again, grad_again) in zip(first, second, strict=True):
        assert y.dtype == torch.bfloat16 and torch.equal(y, y_again) and torch.equal(grad, grad_again)

