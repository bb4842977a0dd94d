"""FasterMoE's shadowing decision (Eq. 7, Eq. 8, Algorithm 1) on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.shadowing import (
    LinkPrices,
    ShadowPrices,
    select_shadowed_experts,
    shadowed_latency,
)

# expert 0 lives on rank 0, expert 1 on rank 1; both ranks send 90 tokens to expert 0, 10 to expert 1
SKEWED = [[90, 10], [90, 10]]
OWNERS = [0, 1]


def _prices(parameter_seconds: float, ranks_per_node: int = 1, intra: float = 0.0) -> ShadowPrices:
    """One second per token computed, 0.1 s per token on a network link in one all-to-all."""
    return ShadowPrices(lambda rows: float(rows), LinkPrices(ranks_per_node, 0.1, intra), parameter_seconds,
                        row_bytes=1)


def test_latency_without_shadowing_is_eq7_on_the_busiest_rank() -> None:
    # rank 0 computes 180 tokens and receives 90 (4 all-to-alls): 180 + 4 * 9 = 216; rank 1: 20 + 36
    assert shadowed_latency(SKEWED, OWNERS, set(), _prices(20.0)) == pytest.approx(216.0)


def test_latency_with_a_shadowed_expert_computes_its_tokens_where_they_are() -> None:
    # rank 1 computes its 90 tokens of expert 0 and all 20 of expert 1, receiving 10: 110 + 4,
    # plus one expert's parameter broadcast and gradient reduce beyond what hides behind the
    # exchanged expert's 20 tokens on rank 1
    assert shadowed_latency(SKEWED, OWNERS, {0}, _prices(20.0)) == pytest.approx(114.0)
    assert shadowed_latency(SKEWED, OWNERS, {0}, _prices(50.0)) == pytest.approx(114.0 + 30.0)
    # nothing left to exchange: nothing hides the two experts' parameters
    assert shadowed_latency(SKEWED, OWNERS, {0, 1}, _prices(20.0)) == pytest.approx(100.0 + 40.0)


def test_algorithm1_shadows_the_hot_expert_and_stops_at_the_first_that_does_not_help() -> None:
    decision = select_shadowed_experts(SKEWED, OWNERS, _prices(50.0))
    assert decision.experts == (0,)  # adding expert 1 (200) is worse than 144: the search stops
    assert decision.latency_without_s == pytest.approx(216.0)
    assert decision.latency_with_s == pytest.approx(144.0)
    assert decision.predicted_gain_s == pytest.approx(72.0)


def test_no_shadowing_when_parameters_cost_more_than_the_imbalance() -> None:
    decision = select_shadowed_experts(SKEWED, OWNERS, _prices(200.0))
    assert decision.experts == () and decision.predicted_gain_s == 0.0


def test_no_shadowing_on_a_balanced_load() -> None:
    balanced = [[50, 50], [50, 50]]
    assert select_shadowed_experts(balanced, OWNERS, _prices(1.0)).experts == ()


def test_several_experts_per_rank_limit_and_parameter_price() -> None:
    # experts 0 and 1 on rank 0 get 80 tokens each, experts 2 and 3 on rank 1 get 20
    tokens = [[40, 40, 10, 10], [40, 40, 10, 10]]
    owners = [0, 0, 1, 1]
    assert shadowed_latency(tokens, owners, set(), _prices(0.0)) == pytest.approx(160 + 4 * 8.0)
    # free parameters: every step lowers the busiest rank (136, 128, 114, 100), so all are shadowed
    assert select_shadowed_experts(tokens, owners, _prices(0.0)).experts == (0, 1, 2, 3)
    assert select_shadowed_experts(tokens, owners, _prices(0.0), limit=1).experts == (0,)
    # at 50 s per expert: {0} costs 136 (its 50 s hide behind rank 0's 80 exchanged tokens),
    # {0, 1} 128 + 100 - 40: the second does not help
    decision = select_shadowed_experts(tokens, owners, _prices(50.0))
    assert decision.experts == (0,) and decision.latency_with_s == pytest.approx(136.0)
    # at 10 s: {0, 1, 2} costs 114 + 30 - 20 (expert 3's 20 tokens still hide some), {0, 1, 2, 3} 100 + 40
    decision = select_shadowed_experts(tokens, owners, _prices(10.0))
    assert decision.experts == (0, 1, 2) and decision.latency_with_s == pytest.approx(124.0)


def test_prices_from_a_calibrated_profile() -> None:
    fits = {"gemm": AlphaBeta(0.0, 1e-9), "alltoall.linear": AlphaBeta(1e-3, 1e-8), "allreduce": AlphaBeta(1e-3, 2e-8)}
    cost = CostModel(ClusterProfile(nodes=2, ranks_per_node=1, fits=fits, interference=1.0))
    prices = ShadowPrices.from_cost_model(cost, model_dim=64, hidden_dim=128, projections=3)
    assert prices.parameter_seconds == pytest.approx(2 * cost.t_allreduce(3 * 64 * 128 * 4))  # forward and backward
    # forward (3 GEMMs) and backward (twice that) of one expert on 10 rows
    assert prices.expert_seconds(10) == pytest.approx(9 * cost.t_gemm(10, 64, 128))
    assert prices.expert_seconds(0) == 0.0 and prices.links.exchange_seconds(np.zeros((2, 2))) == 0.0
    # an even all-to-all of 1000 bytes per rank puts 500 on each link: the fit's time again
    even = np.full((2, 2), 500.0)
    assert prices.links.exchange_seconds(even) == pytest.approx(cost.t_alltoall("linear", 1000))
    assert prices.row_bytes == 256


def test_link_prices_read_the_inter_and_intra_node_fits() -> None:
    """2 nodes x 2 ranks: an even all-to-all of x bytes per rank puts 2 * 2 / 4 x on a node's
    network link and x / 2 on a rank's peer link; each fit's time is that link's traffic priced."""
    fits = {"alltoall.linear": AlphaBeta(1e-3, 1e-8), "alltoall.inter_node": AlphaBeta(2e-3, 4e-8),
            "alltoall.intra_node": AlphaBeta(5e-4, 1e-9)}
    links = LinkPrices.from_cost_model(CostModel(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits)))
    assert links.inter_s_per_byte == pytest.approx(4e-8) and links.intra_s_per_byte == pytest.approx(2e-9)
    assert links.alpha_s == pytest.approx(1e-3)
    remote_only = np.zeros((4, 4))
    remote_only[0, 2] = remote_only[1, 3] = 1000.0  # both ranks of node 0 send to node 1: 2000 bytes up
    assert links.exchange_seconds(remote_only) == pytest.approx(1e-3 + 2000 * 4e-8)
    local_only = np.zeros((4, 4))
    local_only[0, 1] = 1000.0
    assert links.exchange_seconds(local_only) == pytest.approx(1e-3 + 1000 * 2e-9)


def test_the_links_of_a_node_share_its_traffic() -> None:
    """Eq. 2 on 2 nodes x 2 ranks: shadowing the hot expert of node 0 takes its tokens off the
    network link that the two ranks of node 1 share."""
    tokens = [[0, 0, 0, 0], [0, 0, 0, 0], [90, 0, 10, 0], [90, 0, 0, 10]]  # experts 0..3 on ranks 0..3
    owners = [0, 1, 2, 3]
    prices = _prices(0.0, ranks_per_node=2, intra=0.01)
    # node 1 sends 180 tokens up (18 s per all-to-all); rank 0 computes 180
    assert shadowed_latency(tokens, owners, set(), prices) == pytest.approx(180 + 4 * 18)
    # shadowed, ranks 2 and 3 compute their own 90 and their 10: nothing crosses a link
    assert shadowed_latency(tokens, owners, {0}, prices) == pytest.approx(100)


def test_counts_must_have_a_column_per_expert() -> None:
    with pytest.raises(ValueError, match=r"tokens_WE must be \(ranks, experts\) with one column per expert"):
        select_shadowed_experts([[1, 2, 3]], OWNERS, _prices(1.0))


