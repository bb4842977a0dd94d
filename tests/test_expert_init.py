"""Experts are initialized by their global index: with the same seed, a layer on W ranks holds the
experts of the same layer built in one process, in every placement (issue 41), and the random
state after building the layer does not depend on W."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.core.experts import ExpertFFN
from pool import run_distributed

M, H = 8, 16


def _built(parallel: str | int, num_experts: int, mp_size: int, world_size: int) -> MoELayer:
    mp_group = dist.new_subgroups(group_size=mp_size)[0] if mp_size > 1 else None
    group = dist.group.WORLD if world_size > 1 else None
    torch.manual_seed(0)
    return MoELayer(M, H, num_experts, top_k=1, group=group, parallel=parallel, mp_group=mp_group,
                    activation="swiglu")


def _full(rank: int, world_size: int, parallel: str | int, num_experts: int, mp_size: int) -> dict[str, Any]:
    layer = _built(parallel, num_experts, mp_size, world_size)
    after = torch.rand(()).item()  # the global generator after the layer: W must not change it
    return {"state": {k: v.numpy() for k, v in layer.full_state_dict().items()}, "after": after,
            "local": [(s.expert, s.hidden_start, s.hidden_stop) for s in layer.placement.local(rank)]}


@pytest.mark.distributed
@pytest.mark.parametrize(("parallel", "num_experts", "mp_size", "world_sizes"), [
    ("expert", 4, 1, (2, 4)),
    ("replicated", 4, 1, (2, 4)),
    ("adaptive", 2, 1, (4,)),  # Tutel's r with more ranks than experts: experts split by hidden units
    ("s1", 4, 2, (4,)),  # Parm: experts split over the MP group's hidden shards
])
def test_a_layer_on_w_ranks_holds_the_experts_of_one_process(
    parallel: str | int, num_experts: int, mp_size: int, world_sizes: tuple[int, ...]
) -> None:
    one = _built("expert", num_experts, 1, 1)
    expected = {k: v.clone() for k, v in one.state_dict().items()}
    after = torch.rand(()).item()
    for world_size in world_sizes:
        results = run_distributed(_full, world_size, parallel, num_experts, mp_size, timeout_s=120)
        hidden_split = any(stop - start < H for r in results for _, start, stop in r["local"])
        assert hidden_split == (parallel in ("adaptive", "s1")), parallel
        for rank, result in enumerate(results):
            assert result["after"] == after, (world_size, rank)
            for name, tensor in expected.items():
                torch.testing.assert_close(torch.from_numpy(result["state"][name]), tensor, rtol=0, atol=0,
                                           msg=f"{parallel} W={world_size} rank {rank} {name}")


def test_a_hidden_slice_is_that_slice_of_the_whole_expert_and_experts_differ() -> None:
    whole = ExpertFFN(2, M, H, "swiglu", initialize=False)
    whole.reset_by_expert([(3, 0, H), (5, 0, H)], seed=7, full_hidden=H)
    half = ExpertFFN(1, M, H // 2, "swiglu", initialize=False)
    half.reset_by_expert([(3, H // 2, H)], seed=7, full_hidden=H)
    torch.testing.assert_close(half.w1[0], whole.w1[0][:, H // 2:], rtol=0, atol=0)
    torch.testing.assert_close(half.w3[0], whole.w3[0][:, H // 2:], rtol=0, atol=0)
    torch.testing.assert_close(half.w2[0], whole.w2[0][H // 2:], rtol=0, atol=0)
    assert not torch.equal(whole.w1[0], whole.w1[1])
