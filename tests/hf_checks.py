"""Worker functions of the interop tests (module level, so spawned gloo workers can run them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from hf_models import tiny_model
from moeflow.hf import moe_blocks, replace_moe_blocks, to_hf

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_norm", "deepseek_v3")


def whole_model_logits(rank: int, world_size: int, family: str) -> dict[str, float]:
    """Every rank converts the same model with its experts spread over the world, feeds its own
    tokens, and compares logits (and, after ``to_hf``, the gathered weights) with transformers'."""
    hf = tiny_model(family, dtype=torch.float64)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    ours = replace_moe_blocks(copy.deepcopy(hf), dist.group.WORLD if dist.is_initialized() else None, pipeline=1)
    blocks = moe_blocks(ours)
    num_experts = blocks[0].moe.config.num_experts
    generator = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, hf.config.vocab_size, (2, 7 + rank), generator=generator)
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids).logits
    restored = to_hf(ours).state_dict()
    return {
        "logits": (expected - got).abs().max().item(),
        "local_experts": blocks[0].moe.num_local_experts * world_size / num_experts,
        "weights": max((original[k] - restored[k]).abs().max().item() for k in original),
        "same_names": float(sorted(original) == sorted(restored)),
    }
