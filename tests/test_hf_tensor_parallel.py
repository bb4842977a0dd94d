"""Tensor-parallel attention on a transformers model (``--hf --mp-size N``): each member keeps its
block of heads by the model's own plan, and the split model computes the unsplit one's logits and
gradients; families whose plan it cannot run are refused with the reason."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_checks import tensor_parallel_attention
from hf_families import tiny_family_config
from moeflow.hf.tensor_parallel import attention_split
from moeflow.models.tensor_parallel import BlockShards
from pool import run_distributed

SPLIT_FAMILIES = {
    "mixtral": "q, k, v, o",
    "qwen2_moe": "biases on q, k and v",
    "qwen3_moe": "q and k norms kept whole, biases on q, k, v and o (o's added once)",
    "deepseek_v2": "MLA: q_b and kv_b split, the down projections whole",
    "deepseek_v3": "no plan in transformers: deepseek_v2's (the same attention)",
    "gpt_oss": "no plan in transformers: mimo_v2_flash's (sinks), the output bias added once",
    "mimo_v2_flash": "per-head sinks",
    "minimax": "a hybrid: its lightning-attention layers run whole",
    "laguna": "a per-head output gate",
}


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", sorted(SPLIT_FAMILIES))
def test_split_attention_computes_the_whole_models_logits_and_gradients(model_type: str) -> None:
    overrides = {"attention_bias": True} if model_type == "qwen3_moe" else {}
    for result in run_distributed(tensor_parallel_attention, 2, model_type, overrides):
        assert result["logits"] < 1e-6, SPLIT_FAMILIES[model_type]
        assert result["grads"] < 1e-7, SPLIT_FAMILIES[model_type]
        assert result["split"] > 0 and result["heads_here"] == pytest.approx(0.5)  # half of each split tensor


@pytest.mark.parametrize(
    ("model_type", "mp_size", "reason"),
    [
        ("olmoe", 2, "colwise_gather_output"),  # q/k norms over all heads: no head split
        ("jamba", 2, "no tensor-parallel plan for jamba's attention"),
        ("qwen3_moe", 4, "does not divide qwen3_moe's num_key_value_heads=2"),
    ],
)
def test_attention_the_plan_cannot_split_is_refused_with_the_reason(model_type: str, mp_size: int, reason: str) -> None:
    with pytest.raises(ValueError, match="--mp-size") as error:
        attention_split(tiny_family_config(model_type), mp_size)
    assert reason in str(error.value)


def test_block_shards_slice_and_assemble_one_axis() -> None:
    full = torch.arange(24.0).view(4, 6)
    shards = BlockShards(world_size=4, mp_size=2, axis=1, full_size=6)
    blocks = [shards.shard_tensor("weight", full, rank) for rank in range(4)]
    assert torch.equal(blocks[1], full[:, 3:]) and torch.equal(blocks[2], full[:, :3])  # rank 2: a replica of 0
    assembled = shards.empty_full("weight", blocks[0])
    for rank, block in enumerate(blocks):
        shards.write_primary("weight", block, rank, assembled)
    assert torch.equal(assembled, full)
    assert [chunk.offsets for chunk in shards.chunks("weight", blocks[1], 1, primary_only=True)] == [(0, 3)]
    assert shards.chunks("weight", blocks[3], 3, primary_only=True) == []
    with pytest.raises(ValueError, match="not 6"):
        shards.shard_tensor("weight", full[:, :4], 0)
