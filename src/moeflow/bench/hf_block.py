"""One transformers MoE block against moeflow's conversion of it: forward latency by batch size.

    python -m moeflow.bench.hf_block                      # Qwen3-MoE-like: E=64, k=8, M=512, I=256
    python -m moeflow.bench.hf_block --tokens 1 8 --repeats 300

The block's two expert implementations in transformers (``eager``: a loop over the experts hit;
``grouped_mm``: torch's grouped GEMM) and moeflow's :func:`~moeflow.hf.blocks.from_hf_block` of the
same weights run round-robin, one call each per round, in one process, one thread, fp32, no grad;
medians. ``gemms`` is the floor: the same expert GEMMs (and the activation) called directly on
the experts the router picked, nothing else. Each batch size prints one JSON record; the last line
is the summary (the worst ratio to transformers' fastest, the worst ratio to the GEMMs).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _blocks(experts: int, top_k: int, model_dim: int, hidden_dim: int) -> dict[str, nn.Module]:
    """transformers' block in both expert implementations and moeflow's conversion, one set of weights."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from moeflow.hf.blocks import from_hf_block

    config = transformers.Qwen3MoeConfig(
        hidden_size=model_dim, moe_intermediate_size=hidden_dim, num_experts=experts, num_experts_per_tok=top_k,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, head_dim=model_dim // 8,
        vocab_size=128, norm_topk_prob=True)
    blocks: dict[str, nn.Module] = {}
    for implementation in ("eager", "grouped_mm"):
        own = copy.deepcopy(config)
        own._experts_implementation = implementation
        blocks[implementation] = Qwen3MoeSparseMoeBlock(own).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in blocks["eager"].parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    blocks["grouped_mm"].load_state_dict(blocks["eager"].state_dict())
    blocks["moeflow"] = from_hf_block(copy.deepcopy(blocks["eager"])).eval()
    return blocks


def _gemms(block: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """The floor: each picked expert's GEMMs on its tokens, routing done beforehand."""
    layer = block.moe
    x_TM = x.reshape(-1, x.shape[-1])
    logits = F.linear(x_TM, layer.gate.weight)
    experts_TK = torch.topk(logits, layer.config.top_k, dim=-1).indices
    weights = layer.experts.weights()
    weights = type(weights)(*(None if w is None else w.detach().clone() for w in weights.as_tuple()))  # own copy:
    # as cold in cache as each block's weights are when its turn comes
    work = [(e, x_TM[(experts_TK == e).any(dim=1)]) for e in experts_TK.unique().tolist()]

    def run() -> None:
        for expert, rows in work:
            hidden = F.silu(rows @ weights.w1[expert]) * (rows @ weights.w3[expert])
            hidden @ weights.w2[expert]

    return run


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(tokens: list[int], repeats: int, experts: int = 64, top_k: int = 8, model_dim: int = 512,
            hidden_dim: int = 256) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    blocks = _blocks(experts, top_k, model_dim, hidden_dim)
    records = []
    for count in tokens:
        x = torch.randn(1, count, model_dim, generator=torch.Generator().manual_seed(count))
        runs: dict[str, Callable[[], Any]] = {name: (lambda b=block, x=x: b(x)) for name, block in blocks.items()}
        runs["gemms"] = _gemms(blocks["moeflow"], x)
        with torch.no_grad():
            outputs = [blocks[name](x) for name in ("eager", "moeflow")]
            difference = float((outputs[0] - outputs[1]).abs().max())
            samples: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(repeats):
                for name, run in runs.items():
                    samples[name].append(_seconds(run))
        ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        fastest = min(ms["eager"], ms["grouped_mm"])
        records.append({"bench": "hf_block", "tokens": count, "experts": experts, "top_k": top_k,
                        "model_dim": model_dim, "hidden_dim": hidden_dim, **{f"{k}_ms": v for k, v in ms.items()},
                        "fastest_over_moeflow": fastest / ms["moeflow"],
                        "moeflow_over_gemms": ms["moeflow"] / ms["gemms"],
                        "plan_source": blocks["moeflow"].moe.last_stats.plan.source,
                        "max_abs_difference": difference})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 1024])
    parser.add_argument("--repeats", type=int, default=100, help="rounds (medians)")
    args = parser.parse_args()
    records = measure(args.tokens, args.repeats)
    for record in records:
        print(json.dumps(record))
    print(json.dumps({"summary": "hf_block",
                      "worst_fastest_over_moeflow": min(r["fastest_over_moeflow"] for r in records),
                      "worst_moeflow_over_gemms": max(r["moeflow_over_gemms"] for r in records)}))


if __name__ == "__main__":
    main()
