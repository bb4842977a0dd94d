"""Tensor-parallel attention on a transformers model (``--hf --mp-size N``): each member keeps its
block of heads by the model's own plan, and the split model computes the unsplit one's logits and
gradients; families whose plan it cannot run are refused with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_checks import tensor_parallel_attention
from hf_families import tiny_family_config
from moeflow.hf.families import FAMILIES
from moeflow.hf.tensor_parallel import attention_split
from moeflow.models.tensor_parallel import BlockShards
from pool import run_distributed

CASES = {  # what each family's case checks beyond q, k, v and o
    ("qwen2_moe", ()): "biases on q, k and v",
    ("qwen3_moe", (("attention_bias", True),)): "q and k norms kept whole, biases on q, k, v and o (o's added once)",
    ("deepseek_v2", ()): "MLA: q_b and kv_b split, the down projections whole",
    ("glm4_moe_lite", (("q_lora_rank", None),)): "MLA without a query LoRA: q_proj split where the plan names q_b_proj",
    ("deepseek_v3", ()): "no plan in transformers: deepseek_v2's (the same attention)",
    ("gpt_oss", ()): "no plan in transformers: mimo_v2_flash's (sinks), the output bias added once",
    ("mimo_v2_flash", ()): "per-head sinks",
    ("minimax", ()): "a hybrid: its lightning-attention layers run whole",
    ("qwen3_next", (("num_hidden_layers", 4),)): "a hybrid whose fourth layer is full attention",
    ("qwen3_5_moe_text", (("num_hidden_layers", 4),)): "a hybrid whose fourth layer is full attention",
    ("laguna", ()): "a per-head output gate",
}


def _documented_split() -> set[str]:
    """The converted families the Hugging Face guide says split their attention."""
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "huggingface.md").read_text()
    said = guide.split("Of the converted families, ")[1].split("Refused")[0]
    return set(re.findall(r"`([a-z0-9_]+)`", said))


def _splitting_families() -> list[str]:
    """The converted families whose attention the plan (theirs or a borrowed one) splits over 2."""
    accepted = []
    for family in FAMILIES:
        try:
            attention_split(tiny_family_config(family.model_type), 2)
        except ValueError:
            continue
        accepted.append(family.model_type)
    return accepted


def test_the_guide_lists_the_families_that_split() -> None:
    assert _documented_split() == set(_splitting_families())


@pytest.mark.distributed
def test_split_attention_computes_the_whole_models_logits_and_gradients() -> None:
    """Every family that splits (one pool call), with the named cases' settings."""
    named = {model_type: dict(overrides) for model_type, overrides in CASES}
    cases = [(family, named.get(family, {})) for family in _splitting_families()]
    cases += [(model_type, dict(overrides)) for model_type, overrides in CASES if dict(overrides) != named[model_type]
              or model_type not in dict(cases)]
    for result in run_distributed(tensor_parallel_attention, 2, cases):
        assert result.keys() == {f"{model_type}{overrides or ''}" for model_type, overrides in cases}
        for case, figures in result.items():
            assert figures["logits"] < 1e-6 and figures["grads"] < 1e-6, (case, figures)
            assert figures["split"] > 0 and figures["heads_here"] == pytest.approx(0.5), case  # half of each tensor


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
