"""``moeflow bench dedup``: the dedup token exchange (a token crosses to each rank once) against the
ragged one on an emulated cluster: rows, bytes and time, side by side, with the prediction beside them.

Per point (one expert-parallel layer of E / W experts per rank, the same weights and tokens in both
exchanges, dropless at pipeline degree 1): the rows the forward's dispatch sends (all ranks; the
ragged exchange sends every kept row, the dedup one each (token, rank) once) and their ratio against
the share the planner and the simulator price (:func:`moeflow.config.dedup_row_share`, choices spread
uniformly), the all-to-all bytes of one training step (this rank's, the ledger's: the dedup exchange
saves in all four all-to-alls and pays 4 bytes a kept row for the token indices, the gate weights
and their gradients), the rows the dispatch sends between nodes (under ``--alltoall 2dh`` the dedup
exchange sends a token once to each node; the ledger then counts both of its hops, and the ragged
2DH exchange's two phases as one call, so its step bytes do not compare), and the training step's
time (round-robin, the slowest rank's medians)."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from moeflow.progress import Progress

EXCHANGES = ("ragged", "dedup")


@dataclass(frozen=True)
class DedupPoint:
    """One measured layer: E experts of hidden size H over the ranks, T tokens per rank of M, top-k."""

    num_experts: int = 8
    hidden_dim: int = 1024
    tokens: int = 2048
    model_dim: int = 512
    top_k: int = 2
    alltoall: str = "linear"  # 2dh: the dedup exchange sends a token once to each node

    @property
    def name(self) -> str:
        return f"E{self.num_experts}-H{self.hidden_dim}-T{self.tokens}-M{self.model_dim}-k{self.top_k}-{self.alltoall}"


def _layers(point: DedupPoint, groups: Any) -> dict[str, Any]:
    import torch

    from moeflow.moe.layer import MoELayer

    layers = {}
    for token_exchange in EXCHANGES:
        torch.manual_seed(0)  # the same weights in both
        layers[token_exchange] = MoELayer(
            point.model_dim, point.hidden_dim, point.num_experts, top_k=point.top_k, capacity_factor=0.0,
            group=groups, pipeline=1, alltoall=point.alltoall, parallel="expert", token_exchange=token_exchange,
        )
    return layers


def _step_bytes(layer: Any, groups: Any, x: Any) -> int:
    """This rank's all-to-all bytes of one training step of ``layer``."""
    from moeflow.bench.timing import layer_training_step

    sent: list[int] = []
    groups.ledger.on_enter = lambda entry: sent.append(entry.nbytes if "all-to-all" in entry.operation else 0)
    try:
        layer_training_step(layer, x)
    finally:
        groups.ledger.on_enter = None
    return sum(sent)


def _measure_point(point: DedupPoint, groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.timing import round_robin_steps
    from moeflow.config import dedup_row_share

    layers = _layers(point, groups)
    x = torch.randn(point.tokens, point.model_dim, generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    step_bytes = {name: _step_bytes(layer, groups, x) for name, layer in layers.items()}
    crossed = {name: layer.last_stats.cross_node_rows for name, layer in layers.items()}
    stats = layers["dedup"].last_stats
    kept = sum(stats.tokens_per_expert) - stats.dropped
    sent_rows = kept - (stats.dedup_saved_rows or 0)
    train, _, probe = round_robin_steps(layers, x, repeats)
    if dist.get_rank() == 0:
        emit(probe.record("dedup", point.name))
        share = dedup_row_share(point.num_experts, groups.size, point.top_k)
        step_s = {name: statistics.median(times) for name, times in train.items()}
        emit({"bench": "dedup", "config": point.name, "experts_per_rank": point.num_experts // groups.size,
              "dispatch_rows_ragged": kept, "dispatch_rows_dedup": sent_rows,
              "dispatch_rows_over_dedup": kept / max(1, sent_rows), "predicted_rows_over_dedup": 1.0 / share,
              "step_bytes_ragged": step_bytes["ragged"], "step_bytes_dedup": step_bytes["dedup"],
              "step_bytes_over_dedup": step_bytes["ragged"] / max(1, step_bytes["dedup"]),
              "dedup_saved_bytes": stats.dedup_saved_bytes,
              "cross_node_rows_ragged": crossed["ragged"], "cross_node_rows_dedup": crossed["dedup"],
              "train_step_ms_ragged": step_s["ragged"] * 1e3, "train_step_ms_dedup": step_s["dedup"] * 1e3,
              "train_step_over_dedup": step_s["ragged"] / step_s["dedup"]})


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    grid_rank_main(argv, "dedup", lambda values, *rest: _measure_point(DedupPoint(**values), *rest))


def run(
    grid: list[DedupPoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29798, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid (no calibration: nothing here is planned), return
    rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.dedup", "dedup", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, calibrate=False, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point: the dispatch rows' ratio measured and predicted, the step's bytes and time ratios."""
    rows = [r for r in records if r.get("bench") == "dedup"]
    if not rows:
        return {"summary": "dedup", "configs": 0}

    def by_point(key: str) -> dict[str, float]:
        return {f"{r['config']} E/W={r['experts_per_rank']}": round(r[key], 3) for r in rows}

    return {"summary": "dedup", "configs": len(rows), "dispatch_rows_over_dedup": by_point("dispatch_rows_over_dedup"),
            "predicted_rows_over_dedup": by_point("predicted_rows_over_dedup"),
            "step_bytes_over_dedup": by_point("step_bytes_over_dedup"),
            "cross_node_rows_over_dedup": {f"{r['config']} E/W={r['experts_per_rank']}": round(
                r["cross_node_rows_ragged"] / max(1, r["cross_node_rows_dedup"]), 3) for r in rows},
            "train_step_over_dedup": by_point("train_step_over_dedup")}


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
