"""Worker functions of the interop tests (module level, so spawned gloo workers can run them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from hf_models import tiny_model
from moeflow.hf import moe_blocks, replace_moe_blocks, to_hf
from moeflow.parallel.placement import gather_full

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


def tensor_parallel_attention(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> dict[str, dict]:
    """For each (family, config overrides): every member splits the same tiny model's attention over
    the world (its own plan) and feeds the same tokens; the logits, and each gradient (a split one
    assembled from the members' blocks, a whole one averaged over them, as the trainer does),
    against the unsplit model's."""
    return {f"{model_type}{overrides or ''}": _split_against_whole(rank, world_size, model_type, overrides)
            for model_type, overrides in cases}


def _split_against_whole(rank: int, world_size: int, model_type: str, overrides: dict) -> dict[str, float]:
    from hf_families import family_batch, tiny_family_model
    from moeflow.hf.tensor_parallel import split_attention

    whole = tiny_family_model(model_type, seed=0, **overrides)
    split = copy.deepcopy(whole)
    placed = split_attention(split, dist.group.WORLD, world_size)
    logits = {}
    for name, model in (("whole", whole), ("split", split)):
        output = model(input_ids=family_batch(0), use_cache=False)  # a text part has no LM head: its states
        logits[name] = output.logits if hasattr(output, "logits") else output.last_hidden_state
        logits[name].pow(2).mean().backward()
    expected = dict(whole.named_parameters())
    worst = 0.0
    for name, parameter in split.named_parameters():
        if parameter.grad is None:  # (a parameter the tokens do not reach: unused on both)
            assert expected[name].grad is None, name
            continue
        if name in placed:
            sharding, kind = placed[name]
            grad = gather_full(parameter.grad, sharding, kind, rank, dist.group.WORLD)
        else:
            grad = parameter.grad.clone()
            dist.all_reduce(grad)
            grad /= world_size
        worst = max(worst, (grad - expected[name].grad).abs().max().item())
    return {"logits": (logits["whole"] - logits["split"]).abs().max().item(), "grads": worst,
            "split": len(placed), "heads_here": sum(p.numel() for n, p in split.named_parameters() if n in placed)
            / sum(expected[n].numel() for n in placed) if placed else 0.0}
