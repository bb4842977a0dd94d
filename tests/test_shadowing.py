"""FasterMoE's dynamic shadowing in the layer: which experts it shadows, what it reports, and its
errors. (That a shadowed layer equals the reference, outputs and gradients, is in the equivalence
table: the ``shadow-*`` cases on 1, 2 and 4 processes.)"""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.parallel.shadowing import ShadowPlan
from moeflow.perf import AlphaBeta, ClusterProfile
from pool import run_distributed


def _profile(allreduce_beta: float) -> ClusterProfile:
    fits = {"alltoall.linear": AlphaBeta(1e-4, 1e-6), "allreduce": AlphaBeta(1e-6, allreduce_beta),
            "gemm": AlphaBeta(1e-6, 1e-9)}
    return ClusterProfile(nodes=2, ranks_per_node=1, fits=fits)


def _skewed_layer(shadowing: object, profile: ClusterProfile | None) -> MoELayer:
    torch.manual_seed(3)
    layer = MoELayer(8, 12, 4, top_k=1, capacity_factor=0.0, parallel="expert", alltoall="linear",
                     shadowing=shadowing, profile=profile)
    with torch.no_grad():  # expert 0 (on rank 0) wins every token with a positive input
        layer.gate.weight.zero_()
        layer.gate.weight[0].fill_(1.0)
    return layer


def _shadow_stats(rank: int, world_size: int, shadowing: object, allreduce_beta: float | None) -> dict[str, object]:
    layer = _skewed_layer(shadowing, None if allreduce_beta is None else _profile(allreduce_beta))
    x = torch.rand(16, 8) + 0.1  # positive, so the steered gate row wins
    y = layer(x)
    y.sum().backward()
    with torch.no_grad():
        y_inference = layer(x)
    stats = layer.last_stats
    assert stats is not None
    return {
        "shadowed": stats.shadowed_experts, "gain": stats.shadow_predicted_gain_s,
        "inference_equal": torch.allclose(y, y_inference, rtol=1e-6, atol=1e-6),
        "owner_grad": float(layer.experts.w1.grad.abs().sum()),
        "rank_tokens": stats.rank_tokens,
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.slow
def test_auto_shadows_the_hot_expert_when_parameters_are_cheap(world_size: int) -> None:
    results = run_distributed(_shadow_stats, world_size, "auto", 1e-12, timeout_s=180)
    assert all(r["shadowed"][:1] == (0,) for r in results), results  # the same choice on every rank
    assert all(r["gain"] > 0 and r["inference_equal"] for r in results)
    assert results[0]["owner_grad"] > 0  # every rank's gradient reached the owner of expert 0


def test_auto_shadows_nothing_when_parameters_cost_more_than_the_imbalance() -> None:
    results = run_distributed(_shadow_stats, 2, "auto", 1e-2, timeout_s=180)
    assert all(r["shadowed"] == () and r["gain"] == 0.0 for r in results)


def test_a_fixed_list_is_reported_and_priced_only_with_a_profile() -> None:
    results = run_distributed(_shadow_stats, 2, [0, 2], None, timeout_s=180)
    assert all(r["shadowed"] == (0, 2) and r["gain"] is None and r["inference_equal"] for r in results)
    assert all(r["rank_tokens"] == (16, 16) for r in results)  # expert 0's tokens stay with their rank


def test_exchanged_slots_ignore_the_shadowed_experts() -> None:
    counts_WE = torch.tensor([[9, 1, 2], [7, 3, 0]])
    assert ShadowPlan.of((0,), counts_WE, capacity=8) == ShadowPlan((0,), 3)
    assert ShadowPlan.of((1,), counts_WE, capacity=8) == ShadowPlan((1,), 8)  # capped at the capacity
    assert ShadowPlan.of((0, 1, 2), counts_WE, capacity=8).exchanged_slots == 1  # experts stay in the graph


def test_bad_shadowing_settings_name_the_fix() -> None:
    with pytest.raises(ValueError, match="shadowing='auto' decides with FasterMoE's cost model: pass profile="):
        MoELayer(8, 12, 4, shadowing="auto")
    with pytest.raises(ValueError, match="this layer runs parallel='replicated': use parallel='expert'"):
        MoELayer(8, 12, 4, shadowing=[0], parallel="replicated")
    with pytest.raises(ValueError, match=r"shadowing must be 'off', 'auto' or a list of distinct experts in \[0, 4\)"):
        MoELayer(8, 12, 4, shadowing=[4])
    with pytest.raises(ValueError, match="shadowing must be 'off', 'auto' or a list"):
        MoELayer(8, 12, 4, shadowing="on")


def _collective_order(rank: int, world_size: int, token_exchange: str) -> tuple[list[str], int, int]:
    torch.manual_seed(3)
    layer = MoELayer(8, 12, 4, top_k=1, capacity_factor=0.0, parallel="expert", alltoall="linear",
                     shadowing=[0], token_exchange=token_exchange)
    with torch.no_grad():  # expert 0 wins the tokens with a positive input
        layer.gate.weight.zero_()
        layer.gate.weight[0].fill_(1.0)
    x = torch.rand(16, 8) + 0.1
    x[:4] = -x[:4]  # ... and a few go elsewhere, so that something is exchanged
    entered: list[tuple[str, int, str]] = []
    layer.groups.ledger.on_enter = lambda entry: entered.append(
        (entry.operation, entry.nbytes, entry.location.direction or ""))
    layer(x).sum().backward()
    sent = sum(n for op, n, direction in entered if op == "all-to-all" and direction == "forward")
    return [f"{direction} {op}" for op, _, direction in entered], sent, sum(layer.last_stats.tokens_per_expert[1:])


@pytest.mark.distributed
def test_the_shadowed_weights_move_while_the_others_tokens_do_and_none_of_their_tokens_travel() -> None:
    for token_exchange in ("padded", "ragged"):
        order, _, _ = run_distributed(_collective_order, 2, token_exchange, timeout_s=120)[0]
        # posted before the exchange, awaited (and entered in the ledger) only once the exchange is
        # done: the weights' in the forward, the gradients' in the backward
        reduces = (("forward", "shadowed weight all-reduce"), ("backward", "shadowed gradient all-reduce"))
        for direction, reduce in reduces:
            exchanged = [i for i, op in enumerate(order) if op == f"{direction} all-to-all"]
            assert exchanged and order.index(f"{direction} {reduce}") > max(exchanged), order
    padded = run_distributed(_collective_order, 2, "padded", timeout_s=120)
    ragged = run_distributed(_collective_order, 2, "ragged", timeout_s=120)
    not_shadowed = ragged[0][2]  # the kept tokens of experts 1-3, over both ranks
    assert sum(sent for _, sent, _ in ragged) == 2 * not_shadowed * 8 * 4  # dispatch and combine, 8 fp32 each
    assert sum(sent for _, sent, _ in padded) > sum(sent for _, sent, _ in ragged)
