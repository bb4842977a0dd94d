"""``moeflow bench generate``: prefill and decode of transformers MoE models, moeflow against
transformers' own expert implementations, on the same process and weights.

Two random-weight models of realistic shape scaled to a CPU (:data:`MODELS`): a Mixtral-like one
(8 experts, top-2, wide experts) and a Qwen3-MoE-like one (64 experts, top-8, narrow experts). For
each batch size, every implementation generates the same prompts greedily with a KV cache, taking
turns (round-robin) over the repeats: prefill tokens/s, decode tokens/s and the p50/p95 latency of
a decode step. moeflow's MoE blocks are timed during decode against their weight-read floor: the
bytes of the experts a step actually selects over this machine's measured read bandwidth.

With ``--workers 2`` the model runs expert parallel on the emulated cluster (one rank per node,
data-parallel attention, experts split) and the record gives the all-to-all share of a decode step
for pipeline degrees 1 and 2.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moeflow.config import LayerDims
from moeflow.parallel.dispatchers.stats import SOURCE as DIRECT_SOURCE
from moeflow.progress import Progress

HF_IMPLEMENTATIONS = ("eager", "grouped_mm")  # batched_mm pads every expert to all tokens: 10x slower here
MOEFLOW = "moeflow"


def swiglu_dims(model_dim: int, hidden_dim: int, num_experts: int, top_k: int) -> LayerDims:
    """The MoE layer of both families: SwiGLU experts (gate, up (M, H), down (H, M)), no biases."""
    return LayerDims(model_dim, hidden_dim, num_experts, top_k, projections=3, bias=False)


@dataclass(frozen=True)
class ModelShape:
    """A random-weight transformers MoE model: ``dims`` is each MoE layer's (its model dim is the
    model's hidden size)."""

    name: str
    family: str  # mixtral | qwen3_moe
    dims: LayerDims
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 2048

    def __post_init__(self) -> None:
        if (self.dims.projections, self.dims.bias) != (3, False):
            raise ValueError(f"{self.family} experts are SwiGLU without biases: dims need projections=3, "
                             f"bias=False, got {self.dims}")


MODELS = {
    "mixtral": ModelShape("mixtral-like", "mixtral", swiglu_dims(512, 1792, 8, top_k=2), kv_heads=2),
    "qwen3": ModelShape("qwen3-moe-like", "qwen3_moe", swiglu_dims(512, 256, 64, top_k=8)),
}


@dataclass(frozen=True)
class GeneratePoint:
    """One cell: a model at a batch size (per worker)."""

    model: str
    batch: int
    prompt_tokens: int = 32
    new_tokens: int = 16


def hf_config(shape: ModelShape) -> Any:
    import transformers

    dims = shape.dims
    common = dict(vocab_size=shape.vocab, hidden_size=dims.model_dim, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=512,
                  num_experts_per_tok=dims.top_k, tie_word_embeddings=False)
    if shape.family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=dims.hidden_dim,
                                          num_local_experts=dims.num_experts)
    return transformers.Qwen3MoeConfig(**common, head_dim=dims.model_dim // shape.heads,
                                       intermediate_size=2 * dims.model_dim, moe_intermediate_size=dims.hidden_dim,
                                       num_experts=dims.num_experts, norm_topk_prob=True, decoder_sparse_step=1)


def random_model(shape: ModelShape, implementation: str, seed: int = 0) -> nn.Module:
    """The model with seeded weights of unit-ish scale (no denormals from uninitialised memory);
    its own copy of the config, which transformers' ``from_config`` mutates."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(hf_config(shape)),
                                                          experts_implementation=implementation)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.dim() == 1:
                tensor.fill_(1.0)  # norms
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * tensor.shape[-1] ** -0.5)
    return model.eval()


def read_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second one thread reads here (the median of summing a buffer far larger than caches)."""
    buffer = torch.ones(megabytes * (1 << 20) // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times)


def expert_gemm_bandwidth(shape: ModelShape, rows: int, megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes of expert weights per second that torch's GEMMs read here when every expert (laid out
    as moeflow keeps it: gate and up (M, I), down (I, M)) multiplies ``rows`` token rows, one
    thread, weights far larger than caches: the rate the kernel itself allows at decode."""
    m, h, per_expert = shape.dims.model_dim, shape.dims.hidden_dim, shape.dims.expert_parameters
    num_experts = max(1, megabytes * (1 << 20) // (4 * per_expert))
    gate_up = torch.randn(num_experts, 2, m, h)
    down = torch.randn(num_experts, h, m)
    x = torch.randn(rows, m)
    hidden = torch.randn(rows, h)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for pair, matrix in zip(gate_up, down, strict=True):
            torch.mm(x, pair[0])
            torch.mm(x, pair[1])
            torch.mm(hidden, matrix)
        times.append(time.perf_counter() - start)
    return num_experts * per_expert * 4 / statistics.median(times)


@dataclass(frozen=True)
class DecodeFloor:
    """What bounds moeflow's MoE decode in one cell: the median bytes of the experts a step
    selects, this machine's read rate, and torch's GEMM rate at the step's rows per expert."""

    selected_bytes: float
    read_bytes_per_s: float
    rows_per_expert: float
    gemm_bytes_per_s: float

    @staticmethod
    def measure(shape: ModelShape, batch: int, runs: list[Generation], read_bytes_per_s: float) -> DecodeFloor:
        selected = statistics.median(b for run in runs for b in run.floor_bytes)
        # batch x top-k x layers rows over the experts with a token (counted from their bytes)
        rows = batch * shape.dims.top_k * shape.layers / (selected / (4 * shape.dims.expert_parameters))
        return DecodeFloor(selected, read_bytes_per_s, rows, expert_gemm_bandwidth(shape, round(rows)))

    @property
    def seconds(self) -> float:
        return self.selected_bytes / self.read_bytes_per_s


class BlockTimer:
    """Wall time spent in a model's MoE blocks (forward hooks) since the last :meth:`take`."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.seconds = 0.0
        self._started = 0.0
        for block in blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _leave(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._started

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def moe_modules(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of a transformers model, converted or not."""
    from moeflow.hf.blocks import HFMoEBlock
    from moeflow.hf.families import family_of

    return [m for m in model.modules() if isinstance(m, HFMoEBlock) or family_of(m) is not None]


def selected_bytes(model: nn.Module) -> int:
    """Bytes of the expert weights the last forward read on this rank: the experts with a token."""
    from moeflow.hf.blocks import moe_blocks

    total = 0
    for block in moe_blocks(model):
        experts = block.moe.experts
        per_expert = sum(p[0].numel() * p.element_size() for p in experts.parameters())
        local = [shard.expert for shard in block.moe.placement.local(block.moe.rank)]
        counts = block.moe.last_stats.tokens_per_expert if block.moe.last_stats else []
        total += per_expert * sum(1 for e in local if counts[e])
    return total


@dataclass
class Generation:
    """One greedy generation: its tokens and timings."""

    tokens: list[list[int]]
    prefill_s: float
    step_s: list[float]
    moe_step_s: list[float]
    floor_bytes: list[int]


@torch.no_grad()
def greedy_generation(
    model: nn.Module, prompts: torch.Tensor, new_tokens: int, after_forward: Callable[[float], None]
) -> list[list[int]]:
    """Greedy tokens with the KV cache; ``after_forward(seconds)`` runs after every forward, the
    prefill first, then each decode step."""
    tokens = []
    out = None
    for _ in range(new_tokens):
        start = time.perf_counter()
        if out is None:
            out = model(input_ids=prompts, use_cache=True)
        else:
            out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
        after_forward(time.perf_counter() - start)
    return torch.cat(tokens, 1).tolist()


def generate(model: nn.Module, prompts: torch.Tensor, new_tokens: int, timer: BlockTimer) -> Generation:
    """One timed greedy generation: each forward's time, its MoE blocks' time and the bytes of
    the experts it selected (zero for transformers' own blocks)."""
    seconds: list[float] = []
    moe: list[float] = []
    floor: list[int] = []

    def record(elapsed: float) -> None:
        seconds.append(elapsed)
        moe.append(timer.take())
        floor.append(selected_bytes(model))

    tokens = greedy_generation(model, prompts, new_tokens, record)
    return Generation(tokens, seconds[0], seconds[1:], moe[1:], floor[1:])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _models(shape: ModelShape) -> dict[str, nn.Module]:
    """transformers' implementations and moeflow's (the same weights: one seed)."""
    from moeflow.hf import replace_moe_blocks

    models = {name: random_model(shape, name) for name in HF_IMPLEMENTATIONS}
    models[MOEFLOW] = replace_moe_blocks(random_model(shape, "eager"), None, pipeline=1)
    return models


def measure_point(point: GeneratePoint, repeats: int, bandwidth: float) -> list[dict[str, Any]]:
    """The records of one cell on one process: one per implementation, then the comparison."""
    shape = MODELS[point.model]
    models = _models(shape)
    timers = {name: BlockTimer(moe_modules(model)) for name, model in models.items()}
    prompts = torch.randint(0, shape.vocab, (point.batch, point.prompt_tokens),
                            generator=torch.Generator().manual_seed(1))
    runs: dict[str, list[Generation]] = {name: [] for name in models}
    for round_index in range(repeats + 1):  # the first round warms up
        for name, model in models.items():
            run = generate(model, prompts, point.new_tokens, timers[name])
            if round_index:
                runs[name].append(run)
    records = [_implementation_record(point, shape, name, values) for name, values in runs.items()]
    floor = DecodeFloor.measure(shape, point.batch, runs[MOEFLOW], bandwidth)
    return [*records, _comparison_record(point, shape, records, runs, floor)]


def _implementation_record(
    point: GeneratePoint, shape: ModelShape, name: str, runs: list[Generation]
) -> dict[str, Any]:
    steps = [s for run in runs for s in run.step_s]
    prefill = statistics.median(run.prefill_s for run in runs)
    return {
        "bench": "generate", "model": shape.name, "implementation": name, "batch": point.batch,
        "prompt_tokens": point.prompt_tokens, "new_tokens": point.new_tokens,
        "prefill_ms": prefill * 1e3, "prefill_tokens_per_s": point.batch * point.prompt_tokens / prefill,
        "decode_p50_ms": statistics.median(steps) * 1e3, "decode_p95_ms": percentile(steps, 0.95) * 1e3,
        "decode_tokens_per_s": point.batch / statistics.median(steps),
        "moe_decode_ms": statistics.median(s for run in runs for s in run.moe_step_s) * 1e3,
    }


def _comparison_record(point: GeneratePoint, shape: ModelShape, records: list[dict[str, Any]],
                       runs: dict[str, list[Generation]], floor: DecodeFloor) -> dict[str, Any]:
    """moeflow against transformers' fastest; ``kernel_over_floor`` (torch's GEMM rate at the
    step's rows per expert) is where a dispatch that cost nothing would land."""
    by_name = {r["implementation"]: r for r in records}
    fastest_decode = max(HF_IMPLEMENTATIONS, key=lambda n: by_name[n]["decode_tokens_per_s"])
    fastest_prefill = max(HF_IMPLEMENTATIONS, key=lambda n: by_name[n]["prefill_tokens_per_s"])
    ours = by_name[MOEFLOW]
    floor_ms = floor.seconds * 1e3
    return {
        "bench": "generate-compare", "model": shape.name, "batch": point.batch,
        "fastest_hf_decode": fastest_decode, "fastest_hf_prefill": fastest_prefill,
        "decode_speedup_vs_fastest": ours["decode_tokens_per_s"] / by_name[fastest_decode]["decode_tokens_per_s"],
        "decode_speedup_vs_eager": ours["decode_tokens_per_s"] / by_name["eager"]["decode_tokens_per_s"],
        "prefill_speedup_vs_fastest": ours["prefill_tokens_per_s"] / by_name[fastest_prefill]["prefill_tokens_per_s"],
        "moe_decode_ms": ours["moe_decode_ms"], "moe_floor_ms": floor_ms,
        "moe_over_floor": ours["moe_decode_ms"] / floor_ms, "read_gb_per_s": floor.read_bytes_per_s / 1e9,
        "fastest_hf_moe_over_floor": by_name[fastest_decode]["moe_decode_ms"] / floor_ms,
        "rows_per_selected_expert": floor.rows_per_expert,
        "gemm_gb_per_s": floor.gemm_bytes_per_s / 1e9,
        "kernel_over_floor": floor.read_bytes_per_s / floor.gemm_bytes_per_s,
        "same_tokens_as_eager": runs[MOEFLOW][0].tokens == runs["eager"][0].tokens,
        "same_tokens_as_fastest": runs[MOEFLOW][0].tokens == runs[fastest_decode][0].tokens,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    compare = [r for r in records if r["bench"] == "generate-compare"]
    target = [r for r in compare if r["model"] == MODELS["qwen3"].name and r["batch"] == 8]
    floors = [r["moe_over_floor"] for r in compare if r["batch"] in (1, 8)]
    cells = [min(r["decode_speedup_vs_fastest"], r["prefill_speedup_vs_fastest"]) for r in compare]
    return {
        "summary": "generate", "cells": len(compare),
        "qwen3_batch8_decode_speedup_vs_fastest": target[0]["decode_speedup_vs_fastest"] if target else None,
        "worst_cell_speedup_vs_fastest": min(cells) if cells else None,
        "worst_moe_over_floor_batch_1_8": max(floors) if floors else None,
        "all_tokens_identical": all(r["same_tokens_as_eager"] for r in compare),
    }


# -- expert parallel on the emulated cluster -------------------------------------------------------


def measure_cluster_point(values: dict[str, Any], groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    """Every rank: decode with the experts split over the ranks, pipeline degrees 1 and 2 in turn;
    rank 0 reports the slowest rank's step, the all-to-all share of it and the share of MoE forwards
    that took the direct exchange (which runs no pipeline, so both degrees run it alike)."""
    import torch.distributed as dist

    from moeflow.comm.groups import max_over_ranks
    from moeflow.hf import moe_blocks, replace_moe_blocks

    point = GeneratePoint(**values)
    shape = MODELS[point.model]
    models = {degree: replace_moe_blocks(random_model(shape, "eager"), groups, pipeline=degree) for degree in (1, 2)}
    rank = dist.get_rank()
    prompts = torch.randint(0, shape.vocab, (point.batch, point.prompt_tokens),
                            generator=torch.Generator().manual_seed(1 + rank))
    samples: dict[int, list[tuple[float, float]]] = {degree: [] for degree in models}
    for round_index in range(repeats + 1):
        for degree, model in models.items():
            steps = _cluster_steps(model, moe_blocks(model), prompts, point.new_tokens)
            if round_index:
                samples[degree] += [tuple(max_over_ranks(list(step), dist.group.WORLD)) for step in steps]
    if rank == 0:
        for degree, values_ in samples.items():
            step_s = statistics.median(s for s, _, _ in values_)
            emit({"bench": "generate-expert-parallel", "model": shape.name, "batch_per_worker": point.batch,
                  "workers": dist.get_world_size(), "pipeline": degree, "decode_p50_ms": step_s * 1e3,
                  "decode_tokens_per_s": point.batch * dist.get_world_size() / step_s,
                  "alltoall_ms": statistics.median(a for _, a, _ in values_) * 1e3,
                  "alltoall_share": statistics.median(a / s for s, a, _ in values_),
                  "direct_share": statistics.mean(d for _, _, d in values_)})


def _cluster_steps(
    model: nn.Module, blocks: list[Any], prompts: torch.Tensor, new_tokens: int
) -> list[tuple[float, float, float]]:
    """(step seconds, seconds of all-to-all not hidden by expert compute, share of the step's MoE
    forwards that took the direct path) of each decode step."""
    forwards: list[tuple[float, float, float]] = []

    def record(elapsed: float) -> None:
        stats = [b.moe.last_stats for b in blocks]
        direct = sum(s.plan.source == DIRECT_SOURCE for s in stats) / len(stats)
        forwards.append((elapsed, sum(s.timing.total_s - s.timing.expert_total_s for s in stats), direct))

    greedy_generation(model, prompts, new_tokens, record)
    return forwards[1:]  # the prefill left out


def run_cluster(
    grid: list[GeneratePoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    master_port: int = 29780, timeout_s: float = 1800, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.generate", "generate", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          None, master_port, timeout_s, calibrate=False, progress=progress)


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    grid_rank_main(argv, "generate", measure_cluster_point)


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
