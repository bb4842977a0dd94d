"""FasterMoE's topology-aware gate (§4.3): the rule on hand-made scores, the share a profile gives,
and the errors. (That a layer with the gate equals the reference applying the same rule, outputs
and gradients, is in the equivalence table: the ``topology-gate-*`` cases on 1, 2 and 4 processes.)"""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.routing import NodeLimit, node_limited, select_experts
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.reference import ReferenceMoE

LOCAL = torch.tensor([True, True, False, False])  # experts 0 and 1 are on this rank's node

# best expert per token: 2 (remote, 0.9), 0 (local), 3 (remote, 0.6), 3 (remote, 0.8), 1 (local)
SCORES = torch.tensor([
    [0.05, 0.02, 0.90, 0.03],
    [0.70, 0.10, 0.15, 0.05],
    [0.10, 0.20, 0.10, 0.60],
    [0.05, 0.10, 0.05, 0.80],
    [0.10, 0.50, 0.30, 0.10],
])


def test_the_remote_tokens_with_the_best_scores_keep_their_choice_and_the_rest_stay_on_the_node() -> None:
    limited = node_limited(SCORES, NodeLimit(LOCAL, remote_share=0.4))  # L = floor(0.4 * 5) = 2 of 3 remote
    assert limited.argmax(-1).tolist() == [2, 0, 1, 3, 1]  # tokens 0 and 3 (0.9, 0.8) go; token 2 stays (expert 1)
    # token 4's best is local, but its second choice too stays on the node once the limit binds
    assert limited.topk(2).indices.tolist() == [[2, 0], [0, 1], [1, 0], [3, 1], [1, 0]]
    assert SCORES.topk(2).indices[4].tolist() == [1, 2]
    # through select_experts: the weights still come from the unrestricted scores
    choice = select_experts(SCORES.log(), top_k=2, node_limit=NodeLimit(LOCAL, 0.4))
    assert choice.expert_idx_TK.tolist() == limited.topk(2).indices.tolist()
    torch.testing.assert_close(choice.scores_TK, SCORES.gather(1, choice.expert_idx_TK))


def test_nothing_changes_while_the_remote_tokens_fit_under_the_limit() -> None:
    assert torch.equal(node_limited(SCORES, NodeLimit(LOCAL, remote_share=0.6)), SCORES)  # L = 3 = remote
    no_token_leaves = node_limited(SCORES, NodeLimit(LOCAL, remote_share=0.0))
    assert torch.isinf(no_token_leaves[:, 2:]).all() and torch.equal(no_token_leaves[:, :2], SCORES[:, :2])


def test_the_reference_applies_the_same_rule() -> None:
    torch.manual_seed(0)
    reference = ReferenceMoE(6, 8, 4, top_k=2, capacity_factor=0.0, node_experts=[0, 1], remote_share=0.25)
    x = torch.randn(40, 6)
    reference(x)
    chooser = torch.softmax(reference.gate_logits(x), -1)
    expected = torch.topk(node_limited(chooser, NodeLimit(LOCAL, 0.25)), 2, dim=-1).indices
    remote = (~LOCAL[expected]).any(-1)
    assert int(remote.sum()) <= 10  # floor(0.25 * 40) tokens leave the node
    counts = torch.bincount(expected.flatten(), minlength=4).tolist()
    assert reference.tokens_per_expert == counts


def test_auto_takes_the_bandwidth_ratio_from_the_profile() -> None:
    fits = {"alltoall.intra_node": AlphaBeta(1e-5, 1e-10), "alltoall.inter_node": AlphaBeta(1e-4, 2e-9)}
    share = CostModel(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits)).remote_token_share()
    assert share == pytest.approx(1e-10 / (2 * 2e-9))  # W_net / (M W_local)
    one_per_node = ClusterProfile(nodes=2, ranks_per_node=1, fits={"alltoall.inter_node": AlphaBeta(1e-4, 2e-9)})
    assert CostModel(one_per_node).remote_token_share() is None


def test_a_single_node_layer_routes_as_without_the_gate() -> None:
    torch.manual_seed(1)
    gated = MoELayer(6, 8, 4, top_k=2, parallel="expert", topology_gate=0.0)
    torch.manual_seed(1)
    plain = MoELayer(6, 8, 4, top_k=2, parallel="expert")
    x = torch.randn(30, 6)
    assert torch.equal(gated(x), plain(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topology_gate": 1.5}, "topology_gate must be 'off', 'auto' or the share"),
        ({"topology_gate": "on"}, "topology_gate must be"),
        ({"topology_gate": "auto"}, "pass such a profile or the share itself"),
        ({"topology_gate": 0.1, "parallel": "replicated"}, "use parallel='expert' or topology_gate='off'"),
        ({"topology_gate": 0.1, "expert_groups": 2, "top_groups": 1}, "use one of them"),
    ],
)
def test_bad_settings_name_the_argument_and_the_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoELayer(6, 8, 4, top_k=2, **{"parallel": "expert", **kwargs})


def test_top_k_above_the_experts_of_a_node_is_refused() -> None:
    layer = MoELayer(6, 8, 4, top_k=2, parallel="expert", topology_gate=0.2)
    layer.node_limit = NodeLimit(torch.tensor([True, False, False, False]), 0.2)  # as on 4 one-expert nodes
    with pytest.raises(ValueError, match="fewer than top_k=2"):
        layer(torch.randn(3, 6))
