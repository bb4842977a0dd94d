"""``moeflow bench skew``: skewed expert load on an emulated cluster, FasterMoE §5.5-5.6 scaled down.

Routing is set, not learned: the gate's weight is the first E coordinates (times a large scale),
and each token's first E features put a margin on the experts drawn for it from the point's
distribution (uniform, Zipf(s), one expert taking every token, or the load of a recorded training
run's router). Every rank draws its own tokens. The layers run dropless (capacity factor 0) with
the ragged expert kernel, so a hot expert costs what its tokens cost, expert parallel, pipeline
and all-to-all planned per iteration.

Modes, same weights and tokens: ``off`` (no shadowing), ``hottest`` (the most loaded expert
shadowed every iteration), ``auto`` (FasterMoE's Algorithm 1 on the calibrated profile), all with
the planner's pipeline (capacity chunks or the smart schedule, per iteration) and the point's token
exchange (padded, ragged or auto: :mod:`moeflow.parallel.ragged_exchange`); ``smart`` and
``smart+auto``: FasterMoE's smart schedule forced, without and with ``auto`` shadowing;
``redundant``: EPLB's redundant slots (one extra per rank unless set), rebalanced once for the load
of a settled step (what the trainer's rebalancer computes from its recent steps); ``balance``:
``balance='auto'`` with the same slots, rebalanced once for that load, which makes it choose off,
shadowing or the slots (:mod:`moeflow.parallel.balance`). Each
first runs until its planner has settled; then one forward + backward per mode, round-robin, the
slowest rank, medians, and one inference forward per mode beside each step. Per point the record
also gives the max/mean compute load over ranks without and with the shadowing ``auto`` chose, and
with the redundant slots.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from moeflow.progress import Progress

STRONG_SKEW_GOAL = 1.3  # shadowing at strong skew: at least this much faster than off
UNIFORM_TOLERANCE = 1.03  # at uniform load: no slower than this
REDUNDANT_BALANCE_GOAL = 1.1  # redundant experts: max/mean rank load at most this (TensorRT-LLM's EPLB figure)
STEER = 8.0  # the logit margin that pins a token to its drawn expert
BALANCE = "balance"  # the mode whose layer runs balance='auto'
BALANCE_CANDIDATES = ("off", "auto", "redundant")  # the modes balance='auto' chooses among (auto: shadowing)
BALANCE_OFF_TOLERANCE = 1.03  # balance='auto': at most this much slower than off
BALANCE_BEST_TOLERANCE = 1.05  # ... and than the fastest of the techniques it chooses from


@dataclass(frozen=True)
class SkewPoint:
    skew: str  # "uniform", "zipf:<s>", "one-hot", or a name for ``probabilities``
    num_experts: int = 4
    hidden_dim: int = 1024
    tokens: int = 2048
    model_dim: int = 256
    top_k: int = 1
    probabilities: tuple[float, ...] = field(default=())  # a recorded load (the skew names it)
    redundant_experts: int = 0  # extra slots of the redundant mode; 0: one per rank
    token_exchange: str = "padded"  # every mode's: padded, ragged (only kept tokens travel) or auto

    @property
    def name(self) -> str:
        exchange = "" if self.token_exchange == "padded" else f"-{self.token_exchange}"
        return f"{self.skew}-E{self.num_experts}-H{self.hidden_dim}-T{self.tokens}-M{self.model_dim}-k{self.top_k}" \
            f"{exchange}"


def routing_probabilities(point: SkewPoint) -> Any:
    """The share of assignments each expert gets, hottest first (expert 0)."""
    from moeflow.perf.sim.workload import skew_shares

    return skew_shares(point.skew, point.num_experts, point.probabilities)


def routed_tokens(point: SkewPoint, seed: int) -> Any:
    """(T, M) tokens whose first E features pick their experts: k distinct draws from the point's
    distribution (an expert with share 0 is drawn only when fewer than k others remain)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    shares = routing_probabilities(point)
    draw = np.maximum(shares, 1e-9 if point.top_k > 1 else 0.0)
    draw = draw / draw.sum()
    x = torch.randn(point.tokens, point.model_dim, generator=torch.Generator().manual_seed(seed))
    x[:, : point.num_experts] *= 0.1
    for token in range(point.tokens):
        chosen = rng.choice(point.num_experts, size=point.top_k, replace=False, p=draw)
        for rank_in_token, expert in enumerate(chosen):
            x[token, expert] += STEER - rank_in_token  # the first draw gets the largest logit
    return x


def steer_gate(layer: Any) -> None:
    """The gate reads the first E features: logits_e = x_e."""
    import torch

    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[:, : layer.config.num_experts].copy_(torch.eye(layer.config.num_experts))


def recorded_loads(trace: str, steps: int) -> dict[str, tuple[float, ...]]:
    """Each MoE block's share of assignments per expert, averaged over the last ``steps`` records of
    a training run's ``metrics.jsonl`` (a run directory or the file), keyed ``trace-b<block>``."""
    import json
    from pathlib import Path

    path = Path(trace)
    path = path / "metrics.jsonl" if path.is_dir() else path
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("moe")][-steps:]
    if not records:
        raise ValueError("no step records with MoE load (moeflow train writes them to metrics.jsonl)")
    totals: dict[int, list[float]] = {}
    for record in records:
        for block in record["moe"]:
            counts = totals.setdefault(block["block"], [0.0] * len(block["tokens_per_expert"]))
            for expert, count in enumerate(block["tokens_per_expert"]):
                counts[expert] += count
    return {f"trace-b{block}": tuple(c / sum(counts) for c in counts) for block, counts in sorted(totals.items())}


def _measure_point(point: SkewPoint, groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.timing import round_robin_steps, settle_planner
    from moeflow.moe.layer import MoELayer

    rank = dist.get_rank()
    hottest = int(routing_probabilities(point).argmax())
    redundant = point.redundant_experts or dist.get_world_size()
    modes: dict[str, tuple[Any, str, int]] = {  # (shadowing, pipeline, redundant experts)
        "off": ("off", "auto", 0), "hottest": ([hottest], "auto", 0), "auto": ("auto", "auto", 0),
        "smart": ("off", "smart", 0), "smart+auto": ("auto", "smart", 0), "redundant": ("off", "auto", redundant),
        BALANCE: ("off", "auto", redundant),
    }

    def build(name: str, shadowing: Any, pipeline: str, redundant_experts: int) -> MoELayer:
        torch.manual_seed(0)
        layer = MoELayer(
            point.model_dim, point.hidden_dim, point.num_experts, top_k=point.top_k, capacity_factor=0.0,
            group=groups, parallel="expert", pipeline=pipeline, expert_kernel="ragged", profile=profile,
            shadowing=shadowing, redundant_experts=redundant_experts, balance="auto" if name == BALANCE else "fixed",
            token_exchange="padded" if pipeline == "smart" else point.token_exchange,  # smart steps send padded
        )
        steer_gate(layer)
        return layer

    layers = {name: build(name, *setting) for name, setting in modes.items()}
    x = routed_tokens(point, seed=1000 + rank)
    settle = {name: settle_planner(layer, x) for name, layer in layers.items()}
    from moeflow.training.rebalance import rebalance_layer

    for name in ("redundant", BALANCE):  # placed (and for balance, chosen) for a settled step's load
        if rebalance_layer(layers[name], layers[name].last_stats.tokens_per_expert):
            settle[name] += settle_planner(layers[name], x)
    samples, forwards, probe = round_robin_steps(layers, x, repeats)
    if rank == 0:
        emit(probe.record("skew", point.name))
        _emit_point(point, layers, samples, forwards, settle, emit)


def _emit_point(
    point: SkewPoint, layers: dict[str, Any], samples: dict[str, list[float]], forwards: dict[str, list[float]],
    settle: dict[str, int], emit: Any,
) -> None:
    from moeflow.bench import record_fields
    from moeflow.parallel.balance import balance_mode

    medians = {name: statistics.median(values) for name, values in samples.items()}
    forward = {name: statistics.median(values) for name, values in forwards.items()}
    auto = layers["auto"]
    fields = {k: v for k, v in record_fields(point).items() if k != "probabilities"}
    for name, layer in layers.items():
        stats = layer.last_stats
        emit({
            "bench": "skew", "config": point.name, **fields,
            "mode": name, "layer_ms": medians[name] * 1e3, "forward_ms": forward[name] * 1e3,
            "balance": balance_mode(layer.schedule), "slots": layer.num_local_experts * layer.world_size,
            "shadowed": list(stats.shadowed_experts), "token_exchange": stats.plan.token_exchange,
            "predicted_gain_ms": None if stats.shadow_predicted_gain_s is None else stats.shadow_predicted_gain_s * 1e3,
            "schedule": stats.plan.schedule, "degree": stats.plan.requested_degree, "alltoall": stats.plan.alltoall,
            "settle_iterations": settle[name], "tokens_per_expert": stats.tokens_per_expert,
        })
    emit({
        "bench": "skew-compare", "config": point.name, "skew": point.skew,
        "tokens_per_expert": auto.last_stats.tokens_per_expert,
        "auto_over_off_speedup": medians["off"] / medians["auto"],
        "hottest_over_off_speedup": medians["off"] / medians["hottest"],
        "smart_over_off_speedup": medians["off"] / medians["smart"],
        "smart_auto_over_off_speedup": medians["off"] / medians["smart+auto"],
        "redundant_over_off_speedup": medians["off"] / medians["redundant"],
        "redundant_over_auto_speedup": medians["auto"] / medians["redundant"],
        "redundant_over_off_forward_speedup": forward["off"] / forward["redundant"],
        "auto_over_off_forward_speedup": forward["off"] / forward["auto"],
        "redundant_slots": layers["redundant"].placement.experts_per_rank(),
        "auto_planner_schedule": auto.last_stats.plan.schedule,
        "auto_shadowed": list(auto.last_stats.shadowed_experts),
        "max_over_mean_load_off": layers["off"].last_stats.rank_imbalance,
        "max_over_mean_load_auto": auto.last_stats.rank_imbalance,
        "max_over_mean_load_redundant": layers["redundant"].last_stats.rank_imbalance,
        **_balance_fields(layers[BALANCE], medians, forward),
    })


def _balance_fields(layer: Any, medians: dict[str, float], forward: dict[str, float]) -> dict[str, Any]:
    """What ``balance='auto'`` chose for the settled load, its prediction per technique, and its
    measured step against ``off`` and against the fastest of the techniques it chooses from."""
    from moeflow.parallel.balance import choose_execution

    assert layer.cost_model is not None
    choice = choose_execution(layer.config, layer.schedule, layer.groups.topology, layer.cost_model,
                              layer.last_stats.tokens_per_expert).choice
    best = min(BALANCE_CANDIDATES, key=lambda name: medians[name])
    return {
        "balance_mode": choice.mode, "balance_predicted_ms": {k: v * 1e3 for k, v in choice.latency_s.items()},
        "balance_over_off_speedup": medians["off"] / medians[BALANCE],
        "balance_over_off_forward_speedup": forward["off"] / forward[BALANCE],
        "balance_best_mode": best, "balance_over_best_speedup": medians[best] / medians[BALANCE],
    }


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    def measure(values: dict[str, Any], *rest: Any) -> None:
        _measure_point(SkewPoint(**{**values, "probabilities": tuple(values.get("probabilities", ()))}), *rest)

    grid_rank_main(argv, "skew", measure)


def run(
    grid: list[SkewPoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29790, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid, return rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.skew", "skew", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Shadowing's speedup at the strongest skew and its cost at uniform load, against the goals."""
    compare = [r for r in records if r.get("bench") == "skew-compare"]
    if not compare:
        return {"summary": "skew", "configs": 0}
    strong = [r for r in compare if r["skew"] == "one-hot" or r["skew"].startswith("zipf")]
    uniform = [r for r in compare if r["skew"] == "uniform"]
    best_strong = max((r["auto_over_off_speedup"] for r in strong), default=None)
    worst_uniform = min((r["auto_over_off_speedup"] for r in uniform), default=None)
    return {
        "summary": "skew", "configs": len(compare),
        "auto_over_off": {r["config"]: r["auto_over_off_speedup"] for r in compare},
        "strong_skew_best_speedup": best_strong,
        "strong_skew_goal_met": None if best_strong is None else best_strong >= STRONG_SKEW_GOAL,
        "uniform_slowdown": None if worst_uniform is None else 1 / worst_uniform,
        "uniform_goal_met": None if worst_uniform is None else 1 / worst_uniform <= UNIFORM_TOLERANCE,
        "smart_over_off": {r["config"]: r["smart_over_off_speedup"] for r in compare},
        "smart_auto_over_off": {r["config"]: r["smart_auto_over_off_speedup"] for r in compare},
        "redundant_over_off": {r["config"]: r["redundant_over_off_speedup"] for r in compare},
        "redundant_max_over_mean_load": {r["config"]: r["max_over_mean_load_redundant"] for r in compare},
        "redundant_goal_met": all(r["max_over_mean_load_redundant"] <= REDUNDANT_BALANCE_GOAL for r in compare),
        "balance_mode": {r["config"]: r["balance_mode"] for r in compare},
        "balance_over_off": {r["config"]: r["balance_over_off_speedup"] for r in compare},
        "balance_over_best": {r["config"]: r["balance_over_best_speedup"] for r in compare},
        "balance_goal_met": all(1 / r["balance_over_off_speedup"] <= BALANCE_OFF_TOLERANCE
                                and 1 / r["balance_over_best_speedup"] <= BALANCE_BEST_TOLERANCE for r in compare),
    }


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
