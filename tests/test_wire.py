"""Wire formats of the token exchange (``wire_dtype``): each format's rounding bound and bytes on
one process, every algorithm's exchange on 2 and 4 gloo processes against the exact exchange of the
encoded rows, the bytes a layer sends, the settings' checks, and the simulator's and planner's
prices. (The layer's outputs and gradients within each format's bound are in the equivalence table.)"""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.comm.wire import from_wire, to_wire
from moeflow.config import WIRE_DTYPES, MoEConfig, wire_row_bytes
from pool import run_distributed

BOUNDS = {"exact": 0.0, "bf16": 2**-8, "fp8": 2**-4}  # relative rounding of a value, round to nearest


@pytest.mark.parametrize("wire_dtype", WIRE_DTYPES)
def test_a_row_comes_back_within_its_formats_rounding(wire_dtype: str) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 32, generator=generator) * torch.logspace(-3, 3, 6).view(6, 1, 1)
    x[2, 1] = 0.0  # a zero row: its scale must not divide by zero
    sent = to_wire(wire_dtype, x)
    assert sent.shape[:-1] == x.shape[:-1]
    assert sent.shape[-1] * sent.element_size() == wire_row_bytes(wire_dtype, 32, 4)
    back = from_wire(wire_dtype, sent, torch.float32)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert torch.equal(back[2, 1], torch.zeros(32))
    row_max = x.abs().amax(-1, keepdim=True)
    # e4m3's subnormals (scaled values under 2^-6) step by 2^-9: half of it, in the row's scale (max / 448)
    floor = row_max * 2**-10 / 448 if wire_dtype == "fp8" else 0.0
    assert torch.all((back - x).abs() <= BOUNDS[wire_dtype] * x.abs() + floor)
    if wire_dtype != "exact":
        assert not torch.equal(back, x)  # it did round


def test_bf16_leaves_narrow_rows_alone_and_fp8_packs_bf16_rows() -> None:
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert to_wire("bf16", x) is x
    assert to_wire("fp8", x).shape == (4, 20)
    assert from_wire("fp8", to_wire("fp8", x), torch.bfloat16).dtype == torch.bfloat16
    for rows in (0, 1, 3):  # a message of one row whose scale does not start 4-byte aligned (M = 6)
        x = torch.randn(rows, 6)
        assert torch.allclose(from_wire("fp8", to_wire("fp8", x), torch.float32), x, rtol=2**-4, atol=0)
    tiny = torch.full((2, 8), 1e-41)  # denormal rows: a normal scale, no NaN
    assert torch.all(from_wire("fp8", to_wire("fp8", tiny), torch.float32).abs() <= 1e-41)


def _exchanges(rank: int, world_size: int) -> list[str]:
    """Each algorithm's exchange with a wire format returns the exact exchange of the rounded rows."""
    from moeflow.comm.algorithms import exchange

    groups = ParallelGroups(torch.distributed.group.WORLD, Topology(world_size, 2 if world_size > 2 else 1))
    generator = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(world_size * 3, 8, generator=generator)
    matrix = [[1 + (s + d) % 3 for d in range(world_size)] for s in range(world_size)]
    rows = x[: sum(matrix[rank])]
    failures = []
    for algorithm in ("linear", "2dh", "pairwise"):
        for wire_dtype in ("bf16", "fp8"):
            got = exchange(algorithm, rows, groups, matrix, wire_dtype)
            expected = exchange(algorithm, from_wire(wire_dtype, to_wire(wire_dtype, rows), rows.dtype), groups, matrix)
            if not torch.equal(got, expected):
                failures.append(f"rank {rank} {algorithm} {wire_dtype}: differs from the exchange of the rounded rows")
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_algorithm_sends_the_rounded_rows(world_size: int) -> None:
    failures = [failure for result in run_distributed(_exchanges, world_size) for failure in result]
    assert failures == []


WIRE_PATHS = {  # every exchange the feature's record claims, with settings that make rows travel
    "padded": {"token_exchange": "padded"},
    "ragged-d2": {"token_exchange": "ragged", "capacity_factor": 0.0, "pipeline": 2, "expert_kernel": "ragged"},
    "2dh-d2": {"alltoall": "2dh", "pipeline": 2, "token_exchange": "padded"},
    "pairwise": {"alltoall": "pairwise", "token_exchange": "padded"},
    "smart-shadow": {"pipeline": "smart", "shadowing": [0], "capacity_factor": 0.0},
    "redundant": {"redundant_experts": 4, "capacity_factor": 0.0},
    "switchable-r1": {"parallel": 1, "num_experts": 2, "token_exchange": "padded"},
}


def _layer_bytes(rank: int, world_size: int, wire_dtype: str, settings: dict | None = None) -> int:
    """The bytes one training step of a layer sends in its all-to-alls (this rank's)."""
    torch.manual_seed(0)
    groups = ParallelGroups(torch.distributed.group.WORLD, Topology(world_size, 2 if world_size > 2 else 1))
    options = {"token_exchange": "padded", **(settings or {})}
    experts = options.pop("num_experts", 4)
    layer = MoELayer(16, 32, experts, top_k=2, capacity_factor=options.pop("capacity_factor", 1.0), group=groups,
                     wire_dtype=wire_dtype, **options)
    sent: list[int] = []
    groups.ledger.on_enter = lambda entry: sent.append(entry.nbytes if "all-to-all" in entry.operation else 0)
    x = torch.randn(24, 16, requires_grad=True)
    layer(x).sum().backward()
    groups.ledger.on_enter = None
    return sum(sent)


@pytest.mark.distributed
def test_a_layer_sends_what_its_wire_format_says() -> None:
    sent = {wire: run_distributed(_layer_bytes, 2, wire)[0] for wire in WIRE_DTYPES}
    assert sent["exact"] > 0
    assert sent["bf16"] == sent["exact"] // 2
    assert sent["fp8"] == sent["exact"] * (16 + 4) // (16 * 4)


@pytest.mark.distributed
def test_every_exchange_the_record_claims_sends_the_wire_format() -> None:
    """bf16 halves the all-to-all bytes of each path's training step on 4 processes (2 nodes of 2):
    a path that dropped the setting would send the exact bytes."""
    for name, settings in WIRE_PATHS.items():
        exact, bf16 = (run_distributed(_layer_bytes, 4, wire, settings)[0] for wire in ("exact", "bf16"))
        assert exact > 0 and bf16 * 2 == pytest.approx(exact, rel=0.02), name


def test_a_mistyped_wire_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown wire_dtype 'fp16'; choose one of exact, bf16, fp8"):
        MoEConfig(16, 32, 4, wire_dtype="fp16")


def test_a_schedule_without_wire_formats_refuses_one() -> None:
    from moeflow.parallel.registry import check_techniques

    config = MoEConfig(16, 32, 4, wire_dtype="bf16", parallel="s1")
    with pytest.raises(ValueError, match=r"wire_dtype sends the exchanged rows.*wire_dtype='exact'"):
        check_techniques(config, "s1")
    check_techniques(MoEConfig(16, 32, 4, wire_dtype="fp8"), "expert")  # the expert schedule carries it


def test_the_simulator_prices_the_wire_bytes() -> None:
    from moeflow.config import LayerDims
    from moeflow.sim import ModelSpec, StepPlan, load_cluster, simulate_step

    cluster = load_cluster("fastermoe-johnny")
    model = ModelSpec(layers=1, dims=LayerDims(1024, 2048, 2 * cluster.world_size, bias=False), dtype="fp32",
                      tokens_per_rank=4096)
    busy = {wire: simulate_step(cluster, model, StepPlan(wire_dtype=wire), layer_only=True).busy_s["alltoall"]
            for wire in WIRE_DTYPES}
    assert busy["bf16"] == pytest.approx(busy["exact"] / 2, rel=0.05)  # start-ups aside
    assert busy["fp8"] == pytest.approx(busy["exact"] * 1028 / 4096, rel=0.1)
    with pytest.raises(ValueError, match="'s1' sends exact rows: use wire_dtype='exact'"):  # as the layer refuses it
        simulate_step(cluster, model, StepPlan("s1", mp=2, esp=2, wire_dtype="bf16"), layer_only=True)
    assert simulate_step(cluster, model, StepPlan("smart", wire_dtype="bf16"), layer_only=True).step_s > 0


def test_the_planner_prices_a_configs_wire_format() -> None:
    from moeflow.sim import load_cluster, load_model
    from moeflow.sim.planner import SearchSpace, candidate_plans

    cluster, model = load_cluster("fastermoe-johnny"), load_model("fastermoe-gpt")
    plans = candidate_plans(cluster, model, SearchSpace(wire_dtype="bf16"))
    assert plans and all(plan.wire_dtype == "bf16" for plan in plans)
    assert len(plans) == len(candidate_plans(cluster, model))  # every plan beside Parm's carries it
    with pytest.raises(ValueError, match="wire_dtype='bf16'"):
        candidate_plans(cluster, model, SearchSpace(wire_dtype="bf16", mp=2))


def test_the_benchmarks_summaries_judge_the_goals() -> None:
    from moeflow.bench.wire import summarize, summarize_losses

    rows = [{"bench": "wire", "config": "c", "wire_dtype": wire, "exchange_over_exact": ratio,
             "train_step_over_exact": 1.2, "output_max_error": 0.01} for wire, ratio in
            (("exact", 1.0), ("bf16", 1.5), ("fp8", 2.0))]
    summary = summarize(rows)
    assert summary["bf16_exchange_worst"] == 1.5 and summary["bf16_exchange_goal_met"] is False
    assert summarize([])["configs"] == 0
    losses = [{"wire_dtype": "exact", "steps": 200, "loss_over_exact": 0.0},
              {"wire_dtype": "bf16", "steps": 200, "loss_over_exact": -0.012},
              {"wire_dtype": "fp8", "steps": 200, "loss_over_exact": 0.004}]
    assert summarize_losses(losses)["bf16_loss_goal_met"] is False


def test_shadowings_prices_move_tokens_in_the_wire_format() -> None:
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
    from moeflow.perf.shadowing import ShadowPrices

    fits = {"alltoall.linear": AlphaBeta(1e-4, 1e-8), "allreduce": AlphaBeta(1e-4, 1e-8), "gemm": AlphaBeta(1e-6, 1e-9)}
    cost = CostModel(ClusterProfile(nodes=2, ranks_per_node=1, fits=fits))
    rows = {wire: ShadowPrices.from_cost_model(cost, 64, 128, 2, wire_dtype=wire).row_bytes for wire in WIRE_DTYPES}
    assert rows == {"exact": 256, "bf16": 128, "fp8": 68}


def test_fp8_keeps_a_rows_finite_values_beside_an_inf() -> None:
    """The scale comes from the finite values: an inf (or NaN) arrives as NaN and its row's other
    values within e4m3's rounding (an inf took the scale: the whole row decoded as NaN)."""
    row = torch.tensor([[0.5, -0.25, float("inf"), 0.125, float("-inf"), float("nan")]])
    back = from_wire("fp8", to_wire("fp8", row), torch.float32)
    assert torch.equal(back[0, [0, 1, 3]], row[0, [0, 1, 3]])  # powers of two: exact in e4m3
    assert back[0, [2, 4, 5]].isnan().all()
