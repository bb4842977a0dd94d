"""``moeflow bench lina-inference``: Lina's inference scheduling (§7.3) on the emulated cluster.

Per model, every worker runs batches of sequences (data-parallel attention, expert-parallel MoE)
under four schedules in turn, the same batch for each (the order rotates per batch): ``static``
(the layer's expert-parallel placement, padded all-to-all), ``lina`` (placement from the token-path
estimate, re-planned after the gate when the top experts differ), ``oracle`` (placement from the
gate's counts: the paper's "without estimation") and ``ideal`` (a gate forced to a balanced
selection, experts in place: the paper's lower bound; its outputs differ, only its time counts),
and, to tell the placement's gain from the unequal all-to-all's, ``unpadded`` (the static placement
moved like the others, without capacity padding).
A batch's time is the slowest worker's. The profile is recorded first, on other batches.

Models: ``trained`` (a ``moeflow train`` checkpoint, real routing: profiled on its training split,
measured on its validation split) and random-weight Mixtral-like transformers models whose routers
make the load ``skewed`` or leave it ``uniform``: each layer's router is one set of expert
directions plus noise, permuted per layer (each layer has its own popular experts, as Lina's
Table 2), each expert's mean logit raised by its popularity. ``colocated`` is ``skewed`` with each
layer's popular half of the experts on one rank of two under the static placement (Lina's
straggler case); in ``skewed`` the popular experts fall where the permutation puts them.

Records: per schedule the median and p95 batch time and both over
ideal's; the measured skew (max / mean expert load); the estimate's accuracy per layer (top-2 of
the estimate = top-2 of the gate) and the phase-2 rate; the path-length ablation l = 1..6
(accuracy of each l on the same batches, Lina Table 5).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moeflow.comm.collectives import all_gather_objects, barrier
from moeflow.progress import Progress

SCHEDULES = ("static", "lina", "oracle", "ideal", "unpadded")
# the routers' skew (the most over the least popular expert's mean logit) and whether the popular
# experts are the first or the second half of the experts (so that static places them together)
HF_MODELS = {"skewed": (16.0, False), "colocated": (16.0, True), "uniform": (0.0, False)}
P95_VS_IDEAL_GOAL = 1.15
SPEEDUP_GOAL = 1.3  # lina's p95 below static's where the skew is at least SKEW_FOR_GOAL
SKEW_FOR_GOAL = 2.0
UNIFORM_SLOWDOWN_GOAL = 1.03
WARMUP_BATCHES = 2
ABLATION_LENGTHS = (1, 2, 3, 4, 5, 6)


@dataclass(frozen=True)
class LinaPoint:
    model: str  # "trained", "skewed" or "uniform"
    checkpoint: str = ""  # trained: the run folder or step folder
    batch: int = 4  # sequences per worker per batch
    context: int = 64
    batches: int = 20  # timed batches per schedule
    profile_batches: int = 64  # batches per worker the profile is recorded on
    path_length: int = 3
    max_experts_per_rank: int = 8
    replica_slots: int | None = None  # a memory budget: own experts plus at most this many copies per worker


def hf_shape() -> Any:
    from moeflow.bench.generate import ModelShape, swiglu_dims

    return ModelShape("mixtral-like-8L", "mixtral", swiglu_dims(256, 1024, 8, top_k=2), layers=8, heads=4, kv_heads=2)


def router_layout(num_experts: int, model_dim: int, layers: int, skew: float, colocated: bool = False,
                  seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: (E, M) expert directions (shared orthogonal ones, permuted per layer, plus noise
    of a third of their size) and the mean logit of each row, skew * (1/2 - rank / (E - 1)) for
    the row's rank in that layer's popularity; ``colocated``: the popular half of the experts is
    the first half in even layers and the second in odd ones (one rank of two holds them all)."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.linalg.qr(torch.randn(model_dim, num_experts, generator=generator)).Q.t()
    scales = skew * (0.5 - torch.arange(num_experts) / max(1, num_experts - 1))
    rows, row_scales = [], []
    for _ in range(layers):
        order = torch.randperm(num_experts, generator=generator)
        if colocated:
            half = num_experts // 2
            first, second = torch.randperm(half, generator=generator), torch.randperm(half, generator=generator)
            order = torch.cat([first, half + second])
            order = order if len(rows) % 2 == 0 else (order + half) % num_experts
        noise = torch.randn(num_experts, model_dim, generator=generator) * model_dim ** -0.5 / 3
        rows.append((directions + noise)[order])
        row_scales.append(scales[order])
    return rows, row_scales


@torch.no_grad()
def set_routers(model: nn.Module, blocks: list[Any], vocab: int, skew: float, colocated: bool = False,
                temperature: float = 2.0) -> None:
    """Each router, layer by layer: its rows without the direction its inputs share (a random
    model's residual stream has one), each scaled to a logit spread of ``temperature`` on
    calibration tokens (so that no expert is favoured by the geometry of the hidden states), then
    the shared direction added back in the measure that gives each expert its skewed mean logit."""
    ids = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(12345))
    weights = [block.moe.gate.weight for block in blocks]
    rows, scales = router_layout(weights[0].shape[0], weights[0].shape[1], len(blocks), skew, colocated)
    for block, weight, row, scale in zip(blocks, weights, rows, scales, strict=True):
        inputs = _router_inputs(model, block, ids)
        unit = inputs.mean(0) / inputs.mean(0).norm()
        row = row - torch.outer(row @ unit, unit)
        spread = (inputs @ row.t()).std(0)
        shared = (inputs @ unit).mean()
        weight.copy_(row / spread[:, None] * temperature + torch.outer(scale / shared, unit))


@torch.no_grad()
def quiet_attention(model: nn.Module, factor: float = 0.1) -> nn.Module:
    """Scale the attention outputs down: random attention averages a sequence into one shared
    direction that would route a whole sequence alike; a trained model's tokens keep their own."""
    for name, parameter in model.named_parameters():
        if name.endswith("o_proj.weight"):
            parameter.mul_(factor)
    return model


def _router_inputs(model: nn.Module, block: Any, ids: torch.Tensor) -> torch.Tensor:
    """The (tokens, M) inputs of ``block``'s router when ``model`` runs ``ids``."""
    seen: list[torch.Tensor] = []
    handle = block.moe.register_forward_pre_hook(lambda _, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    model(input_ids=ids, use_cache=False)
    handle.remove()
    return torch.cat(seen)


def hf_model(skew: float, groups: Any, colocated: bool = False) -> nn.Module:
    """The random Mixtral-like model with skewed routers, its MoE blocks on moeflow over ``groups``
    (built the same on every rank: the routers are calibrated on the same tokens everywhere, on one
    process before the experts are spread)."""
    from moeflow.bench.generate import random_model
    from moeflow.hf import moe_blocks, replace_moe_blocks

    shape = hf_shape()
    model = replace_moe_blocks(quiet_attention(random_model(shape, "eager")))
    blocks = moe_blocks(model)
    set_routers(model, blocks, shape.vocab, skew, colocated)
    routers = [block.moe.gate.weight.detach().clone() for block in blocks]
    # a fixed plan, as the trained model's: no online planner trial lands in the static times
    spread = replace_moe_blocks(quiet_attention(random_model(shape, "eager")), groups, pipeline=1, alltoall="linear")
    for block, router in zip(moe_blocks(spread), routers, strict=True):
        block.moe.gate.weight.data.copy_(router)
    return spread


# -- every rank ---------------------------------------------------------------------------------


@dataclass
class _Setup:
    """One model twice (the static placement, and every expert everywhere for the schedulers),
    how to run a batch, and this rank's profile and measured batches."""

    static: nn.Module
    scheduled: nn.Module
    layers: list[Any]  # the scheduled model's MoE layers
    static_layers: list[Any]
    forward: Any
    profile_batches: list[torch.Tensor]
    batches: list[torch.Tensor]


def _random_batches(count: int, point: LinaPoint, vocab: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (point.batch, point.context), generator=generator) for _ in range(count)]


def _stream_batches(stream: np.ndarray, count: int, point: LinaPoint, rank: int, world: int) -> list[torch.Tensor]:
    """Consecutive windows of a token stream, this rank's share of each batch."""
    from moeflow.inference.profiling import token_batches

    tokens = count * world * point.batch * point.context
    windows = token_batches(stream, point.context, point.batch * world, tokens)
    if len(windows) < count or windows[-1].shape[0] < point.batch * world:
        raise ValueError(f"the corpus holds fewer than {tokens} tokens for {count} batches: use fewer or smaller")
    return [w[rank * point.batch: (rank + 1) * point.batch] for w in windows[:count]]


def _setup(point: LinaPoint, groups: Any) -> _Setup:
    import torch.distributed as dist

    from moeflow.hf import moe_blocks

    rank, world = dist.get_rank(), dist.get_world_size()
    count = point.batches + WARMUP_BATCHES
    if point.model == "trained":
        import os

        from moeflow.data import default_cache_root
        from moeflow.training.generate import checkpoint_corpus, load_model

        static, _, checkpoint = load_model(point.checkpoint, groups)
        scheduled, _, _ = load_model(point.checkpoint, groups)
        corpus = checkpoint_corpus(checkpoint, default_cache_root(os.environ))
        return _Setup(static, scheduled, scheduled.moe_layers(), static.moe_layers(), lambda m, b: m(b),
                      _stream_batches(corpus.load("train"), point.profile_batches, point, rank, world),
                      _stream_batches(corpus.load("val"), count, point, rank, world))
    skew, colocated = HF_MODELS[point.model]
    static, scheduled = hf_model(skew, groups, colocated), hf_model(skew, groups, colocated)
    vocab = hf_shape().vocab
    return _Setup(static, scheduled, [b.moe for b in moe_blocks(scheduled)], [b.moe for b in moe_blocks(static)],
                  lambda m, b: m(input_ids=b, use_cache=False),
                  _random_batches(point.profile_batches, point, vocab, 1000 + rank),
                  _random_batches(count, point, vocab, 2000 + rank))


def _gathered_routes(local: list[np.ndarray]) -> list[np.ndarray]:
    """Per forward, every rank's (T, layers, k) routes stacked (rank order)."""

    everyone: list[list[np.ndarray] | None] = all_gather_objects(local)
    return [np.concatenate([routes[i] for routes in everyone if routes is not None]) for i in range(len(local))]


def _profile(setup: _Setup) -> Any:
    """Every rank records its tokens' routes on its profile batches; the profile is built from all."""
    from moeflow.inference.profiling import profile_routing

    return profile_routing(setup.layers, lambda batch: setup.forward(setup.scheduled, batch), setup.profile_batches,
                           max(ABLATION_LENGTHS), gather=_gathered_routes)


def _timed(setup: _Setup, model: nn.Module, batch: torch.Tensor) -> float:
    """The slowest rank's seconds for one batch."""
    import torch.distributed as dist

    from moeflow.comm.groups import max_over_ranks

    barrier()
    start = time.perf_counter()
    with torch.no_grad():
        setup.forward(model, batch)
    return max_over_ranks([time.perf_counter() - start], dist.group.WORLD)[0]


def _expert_skew(layers: list[Any]) -> list[float]:
    """max / mean of each layer's expert load in its last forward (all ranks)."""
    return [max(layer.last_stats.tokens_per_expert) / float(np.mean(layer.last_stats.tokens_per_expert))
            for layer in layers]


def accuracy_by_length(profile: Any, forwards: list[np.ndarray], top_k: int, compare_top: int,
                       lengths: tuple[int, ...] = ABLATION_LENGTHS) -> dict[int, list[float]]:
    """For each path length: per layer, the share of forwards whose estimated top experts are the
    gate's (every rank's tokens of a forward together, as the scheduler sums them)."""
    from moeflow.inference.scheduler import top_experts

    result: dict[int, list[float]] = {}
    for length in lengths:
        hits = np.zeros(profile.num_layers)
        for routes in forwards:
            for layer in range(profile.num_layers):
                estimate = profile.estimate(layer, routes[:, :layer, 0], top_k, path_length=length)
                actual = np.bincount(routes[:, layer].reshape(-1), minlength=profile.num_experts)
                hits[layer] += top_experts(estimate, compare_top) == top_experts(actual, compare_top)
        result[length] = (hits / max(1, len(forwards))).tolist()
    return result


def measure_point(values: dict[str, Any], groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    """Every rank: profile, then the measured batches under each schedule in turn; rank 0 emits."""
    import torch.distributed as dist

    from moeflow.inference import InferenceScheduler, SchedulerSettings, schedule_layers
    from moeflow.inference.scheduler import summarize_records
    from moeflow.perf import CostModel

    point = LinaPoint(**values)
    # a replica budget prices its copies on the calibrated cluster (Lina's cost model)
    cost = None if profile is None or point.replica_slots is None else CostModel(profile)
    setup = _setup(point, groups)
    routing = _profile(setup)
    num_layers, top_k = len(setup.layers), setup.layers[0].config.top_k
    settings = {name: SchedulerSettings(name, max_experts_per_rank=point.max_experts_per_rank,
                                        path_length=point.path_length,
                                        replica_slots=None if name in ("ideal", "unpadded") else point.replica_slots)
                for name in SCHEDULES[1:]}
    schedulers = {"lina": InferenceScheduler(settings["lina"], num_layers, routing, cost=cost),
                  "oracle": InferenceScheduler(settings["oracle"], num_layers, keep_routes=True, cost=cost),
                  "ideal": InferenceScheduler(settings["ideal"], num_layers),
                  "unpadded": InferenceScheduler(settings["unpadded"], num_layers)}
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    skews: list[list[float]] = []
    for index, batch in enumerate(setup.batches):
        for name in SCHEDULES[index % len(SCHEDULES):] + SCHEDULES[: index % len(SCHEDULES)]:
            if name != "static":
                schedule_layers(setup.layers, schedulers[name])
            seconds = _timed(setup, setup.static if name == "static" else setup.scheduled, batch)
            if index >= WARMUP_BATCHES:
                times[name].append(seconds)
                if name == "static":
                    skews.append(_expert_skew(setup.static_layers))
    lina = summarize_records(schedulers["lina"].take_records()[WARMUP_BATCHES * num_layers:])
    forwards = _gathered_routes(schedulers["oracle"].routes[WARMUP_BATCHES:])
    if dist.get_rank() != 0:
        return
    skew = float(np.median([np.mean(layers) for layers in skews]))
    expert_mb = _expert_bytes(setup) / 2**20
    ideal = {q: _quantile(times["ideal"], q) for q in (0.5, 0.95)}
    common = {"model": point.model, "workers": dist.get_world_size(), "batch_per_worker": point.batch,
              "context": point.context, "batches": point.batches, "skew": skew}
    for name in SCHEDULES:
        median, p95 = _quantile(times[name], 0.5), _quantile(times[name], 0.95)
        emit({"bench": "lina-inference", **common, "schedule": name, "median_ms": median * 1e3, "p95_ms": p95 * 1e3,
              "median_vs_ideal": median / ideal[0.5], "p95_vs_ideal": p95 / ideal[0.95]})
    emit({"bench": "lina-inference-estimate", **common, "path_length": point.path_length,
          "accuracy": lina["accuracy"], "phase2_rate": lina["phase2_rate"],
          "accuracy_per_layer": [layer["accuracy"] for layer in lina["layers"]],
          "skew_per_layer": np.median(np.array(skews), axis=0).tolist(),
          "rank_skew_lina": lina["rank_skew"], "replica_slots": point.replica_slots,
          "fetched_experts_per_forward": lina["fetched_per_forward"] * num_layers,
          "fetched_mb_per_forward": lina["fetched_per_forward"] * num_layers * expert_mb,
          "moved_mb_per_forward": lina["moved_per_forward"] * num_layers * expert_mb,
          "late_mb_per_forward": lina["late_per_forward"] * num_layers * expert_mb,
          "max_experts_per_worker": lina["max_experts_held"],
          "max_expert_mb_per_worker": lina["max_experts_held"] * expert_mb,
          "cost_model": cost is not None,
          "own_experts_per_worker": setup.layers[0].config.num_experts // dist.get_world_size()})
    for length, per_layer in accuracy_by_length(routing, forwards, top_k, settings["lina"].compare_top).items():
        emit({"bench": "lina-inference-path-length", **common, "path_length": length,
              "accuracy": float(np.mean(per_layer)), "accuracy_per_layer": per_layer})


def _expert_bytes(setup: Any) -> int:
    """One expert's weights in bytes."""
    layer = setup.layers[0]
    return layer.config.dims.expert_parameters * layer.experts.w1.element_size()


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else float("nan")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model: lina's p95 over ideal's, static's p95 over lina's, and whether the goals hold."""
    models: dict[str, Any] = {}
    for record in records:
        if record.get("bench") == "lina-inference":
            models.setdefault(record["model"], {"skew": record["skew"]})[record["schedule"]] = record
    summary: dict[str, Any] = {"summary": "lina-inference"}
    for model, rows in models.items():
        if not all(name in rows for name in SCHEDULES):
            continue
        lina, static = rows["lina"], rows["static"]
        speedup = static["p95_ms"] / lina["p95_ms"]
        summary[model] = {
            "skew": rows["skew"], "lina_p95_vs_ideal": lina["p95_vs_ideal"], "static_p95_over_lina": speedup,
            "static_median_over_lina": static["median_ms"] / lina["median_ms"],
            "oracle_p95_vs_ideal": rows["oracle"]["p95_vs_ideal"],
            "unpadded_p95_over_lina": rows["unpadded"]["p95_ms"] / lina["p95_ms"],
            "goal_p95_within_ideal": lina["p95_vs_ideal"] <= P95_VS_IDEAL_GOAL,
            "goal_speedup": speedup >= SPEEDUP_GOAL if rows["skew"] >= SKEW_FOR_GOAL else None,
            "goal_uniform": lina["median_ms"] <= UNIFORM_SLOWDOWN_GOAL * static["median_ms"]
            if model == "uniform" else None,
        }
    return summary


def run_cluster(points: list[LinaPoint], nodes: int, ranks_per_node: int, inter_gbit: float,
                profile: str | None = None, master_port: int = 29790, timeout_s: float = 3600,
                progress: Progress | None = None) -> list[dict[str, Any]]:
    """The points on the emulated cluster; calibrated first (or on ``profile``) when a point has a
    replica budget, whose copies the cost model prices."""
    from moeflow.bench import run_on_cluster

    budget = any(point.replica_slots is not None for point in points)
    return run_on_cluster("moeflow.bench.lina_inference", "lina-inference", points, nodes, ranks_per_node,
                          inter_gbit, 1, profile, master_port, timeout_s, calibrate=budget, progress=progress)


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    grid_rank_main(argv, "lina-inference", measure_point)


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
