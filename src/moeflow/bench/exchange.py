"""``moeflow bench exchange``: the ragged token exchange against the padded one on an emulated cluster.

The same layer, weights and tokens four ways: ``padded-bmm`` (the padded exchange and the padded
``bmm`` kernel: nothing ragged), ``padded`` (the padded exchange with the ragged kernel, forward and
backward), ``ragged`` (the ragged exchange and kernel: only kept rows travel and compute) and
``auto`` (the ragged kernel; each chunk ragged where it leaves enough of its slots empty, else
padded). Routing is set as in ``bench skew`` (uniform, Zipf(s), one-hot, or a recorded load; every
rank draws its own tokens), at the point's capacity factor (0: dropless). Each mode first runs until
its planner has settled; then, round-robin, one training step (forward + backward) and one inference
forward per mode, the slowest rank, medians. Per point: the bytes each mode sent in one training
step's all-to-alls (this rank's) and the speedups of ragged and auto over padded."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from moeflow.progress import Progress

MODES = {"padded-bmm": ("padded", "bmm"), "padded": ("padded", "ragged"), "ragged": ("ragged", "ragged"),
         "auto": ("auto", "ragged")}
"""Each mode's (token_exchange, expert_kernel)."""
DROPLESS_SKEW_GOAL = 1.2  # ragged over padded, dropless at Zipf(1.2)
UNIFORM_TOLERANCE = 1.0  # ragged over padded at uniform load with f = 1: never slower (the medians' noise aside)


@dataclass(frozen=True)
class ExchangePoint:
    """One measured point: the routing distribution, the capacity factor (0: dropless) and the layer."""

    skew: str  # "uniform", "zipf:<s>", "one-hot", or a name for ``probabilities``
    capacity_factor: float = 0.0
    num_experts: int = 8
    hidden_dim: int = 1024
    tokens: int = 2048
    model_dim: int = 512
    top_k: int = 2
    pipeline: int | str = "auto"  # every mode's pipeline policy, or one degree for all (the exchange alone differs)
    probabilities: tuple[float, ...] = field(default=())

    @property
    def name(self) -> str:
        return (f"{self.skew}-f{self.capacity_factor:g}-E{self.num_experts}-H{self.hidden_dim}-T{self.tokens}"
                f"-M{self.model_dim}-k{self.top_k}-d{self.pipeline}")


def _skew_point(point: ExchangePoint) -> Any:
    from moeflow.bench.skew import SkewPoint

    return SkewPoint(point.skew, point.num_experts, point.hidden_dim, point.tokens, point.model_dim, point.top_k,
                     point.probabilities)


def _sent_bytes(layer: Any, x: Any) -> int:
    """This rank's all-to-all bytes of one training step of ``layer`` (a smart plan's pairwise steps
    too), counted as the ledger enters them (its ring keeps only the last few)."""
    from moeflow.bench.timing import layer_training_step

    ledger, sent = layer.groups.ledger, []
    ledger.on_enter = lambda entry: sent.append(entry.nbytes if "all-to-all" in entry.operation else 0)
    try:
        layer_training_step(layer, x)
    finally:
        ledger.on_enter = None
    return sum(sent)


def _measure_point(point: ExchangePoint, groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.skew import routed_tokens, steer_gate
    from moeflow.bench.timing import round_robin_steps, settle_planner
    from moeflow.moe.layer import MoELayer

    def build(token_exchange: str, expert_kernel: str) -> MoELayer:
        torch.manual_seed(0)
        layer = MoELayer(
            point.model_dim, point.hidden_dim, point.num_experts, top_k=point.top_k,
            capacity_factor=point.capacity_factor, group=groups, parallel="expert", expert_kernel=expert_kernel,
            profile=profile, token_exchange=token_exchange, pipeline=point.pipeline,
            alltoall="linear" if isinstance(point.pipeline, int) else "auto",  # a fixed degree: one algorithm too
        )
        steer_gate(layer)
        return layer

    layers = {mode: build(*settings) for mode, settings in MODES.items()}
    x = routed_tokens(_skew_point(point), seed=1000 + dist.get_rank())
    settle = {mode: settle_planner(layer, x) for mode, layer in layers.items()}
    sent = {mode: _sent_bytes(layer, x) for mode, layer in layers.items()}
    train, infer, probe = round_robin_steps(layers, x, repeats)
    if dist.get_rank() == 0:
        emit(probe.record("exchange", point.name))
        _emit_point(point, layers, train, infer, settle, sent, emit)


def _emit_point(
    point: ExchangePoint, layers: dict[str, Any], train: dict[str, list[float]], infer: dict[str, list[float]],
    settle: dict[str, int], sent: dict[str, int], emit: Any,
) -> None:
    from moeflow.bench import record_fields

    step = {mode: statistics.median(values) for mode, values in train.items()}
    forward = {mode: statistics.median(values) for mode, values in infer.items()}
    fields = {k: v for k, v in record_fields(point).items() if k != "probabilities"}
    for mode, layer in layers.items():
        plan = layer.last_stats.plan
        emit({
            "bench": "exchange", "config": point.name, **fields, "mode": mode,
            "train_step_ms": step[mode] * 1e3, "forward_ms": forward[mode] * 1e3, "sent_mb": sent[mode] / 2**20,
            "token_exchange": plan.token_exchange, "expert_kernel": plan.expert_kernel,
            "degree": plan.requested_degree, "alltoall": plan.alltoall,
            "settle_iterations": settle[mode], "dropped": sum(layer.last_stats.dropped_per_expert),
            "tokens_per_expert": layer.last_stats.tokens_per_expert,
        })
    emit({
        "bench": "exchange-compare", "config": point.name, "skew": point.skew,
        "capacity_factor": point.capacity_factor,
        "tokens_per_expert": layers["padded"].last_stats.tokens_per_expert,
        "ragged_over_padded_train": step["padded"] / step["ragged"],
        "ragged_over_padded_forward": forward["padded"] / forward["ragged"],
        "ragged_over_padded_bmm_train": step["padded-bmm"] / step["ragged"],
        "ragged_over_padded_bmm_forward": forward["padded-bmm"] / forward["ragged"],
        "auto_over_padded_train": step["padded"] / step["auto"],
        "auto_over_padded_forward": forward["padded"] / forward["auto"],
        "sent_ragged_over_padded": sent["ragged"] / max(1, sent["padded"]),
        "sent_auto_over_padded": sent["auto"] / max(1, sent["padded"]),
    })


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    def measure(values: dict[str, Any], *rest: Any) -> None:
        _measure_point(ExchangePoint(**{**values, "probabilities": tuple(values.get("probabilities", ()))}), *rest)

    grid_rank_main(argv, "exchange", measure)


def run(
    grid: list[ExchangePoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29795, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid, return rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.exchange", "exchange", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Ragged over padded per point, against the goals: never slower at uniform load with f = 1,
    at least 1.2x dropless at Zipf(1.2) (the ragged path against the padded exchange with the same
    ragged kernel, and against the wholly padded one)."""
    compare = [r for r in records if r.get("bench") == "exchange-compare"]
    if not compare:
        return {"summary": "exchange", "configs": 0}
    uniform = [r for r in compare if r["skew"] == "uniform" and r["capacity_factor"] == 1.0]
    skewed = [r for r in compare if r["skew"] == "zipf:1.2" and r["capacity_factor"] == 0.0]
    worst_uniform = min((min(r["ragged_over_padded_train"], r["ragged_over_padded_forward"]) for r in uniform),
                        default=None)
    skewed_train = min((r["ragged_over_padded_train"] for r in skewed), default=None)
    skewed_bmm = min((r["ragged_over_padded_bmm_train"] for r in skewed), default=None)
    return {
        "summary": "exchange", "configs": len(compare),
        "ragged_over_padded_train": {r["config"]: r["ragged_over_padded_train"] for r in compare},
        "ragged_over_padded_forward": {r["config"]: r["ragged_over_padded_forward"] for r in compare},
        "ragged_over_padded_bmm_train": {r["config"]: r["ragged_over_padded_bmm_train"] for r in compare},
        "auto_over_padded_train": {r["config"]: r["auto_over_padded_train"] for r in compare},
        "sent_auto_over_padded": {r["config"]: r["sent_auto_over_padded"] for r in compare},
        "uniform_worst_ratio": worst_uniform,
        "uniform_goal_met": None if worst_uniform is None else worst_uniform >= UNIFORM_TOLERANCE,
        "dropless_zipf_train_ratio": skewed_train,
        "dropless_zipf_goal_met": None if skewed_train is None else skewed_train >= DROPLESS_SKEW_GOAL,
        "dropless_zipf_over_padded_bmm_train": skewed_bmm,
    }


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
