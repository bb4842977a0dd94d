"""``moeflow bench hf-ep``: transformers' own expert parallelism against moeflow's backend inside
transformers (``ep_implementation="moeflow"``), on the same model, side by side in one run.

Per point: a Qwen3-MoE-like model of random weights (saved by rank 0, loaded by every rank as a
user loads one), each rank its own batch, loaded once per implementation with
``DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation=...)`` (FSDP2 on the dense part, each
rank W-th of the experts) and given AdamW. First the logits of one no-grad forward, checked equal
between the implementations (the largest difference is reported); then training steps (forward,
backward, optimizer), one per implementation per round, round-robin after a warm-up round, the
slowest rank's medians. ``step_over_moeflow`` > 1: moeflow's backend is faster.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

IMPLEMENTATIONS = ("all_to_all", "moeflow")
"""transformers' own all-to-all, and moeflow's backend with its defaults."""


@dataclass(frozen=True)
class HFEPPoint:
    """One measured model: E experts of hidden size H_e, k per token, hidden size M, L MoE layers,
    B sequences of S tokens per rank."""

    num_experts: int = 16
    top_k: int = 4
    hidden_size: int = 256
    moe_hidden: int = 256
    layers: int = 2
    batch: int = 4
    seq: int = 128
    implementations: tuple[str, ...] = field(default=IMPLEMENTATIONS)

    @property
    def name(self) -> str:
        return (f"E{self.num_experts}-k{self.top_k}-M{self.hidden_size}-He{self.moe_hidden}-L{self.layers}"
                f"-T{self.batch * self.seq}")


def _saved_model(point: HFEPPoint, folder: str) -> None:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=point.hidden_size, intermediate_size=2 * point.hidden_size,
        moe_intermediate_size=point.moe_hidden, num_hidden_layers=point.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=point.hidden_size // 4, num_experts=point.num_experts,
        num_experts_per_tok=point.top_k, decoder_sparse_step=1, max_position_embeddings=max(256, point.seq),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def _loaded(folder: str, world: int, implementation: str) -> tuple[Any, Any]:
    import torch
    import transformers
    from transformers.distributed import DistributedConfig

    import moeflow.hf  # noqa: F401  registers ep_implementation="moeflow"

    layout = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation=implementation)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=layout)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def _step(model: Any, optimizer: Any, ids: Any) -> None:
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_point(rank: int, world: int, point: HFEPPoint, repeats: int) -> dict[str, Any] | None:
    """Every rank's part of one point; rank 0's record."""
    import tempfile

    import torch
    import torch.distributed as dist

    from moeflow.comm.collectives import barrier, broadcast_objects
    from moeflow.timing.measure import slowest_rank_seconds

    with tempfile.TemporaryDirectory() as mine:
        shared = [mine]
        broadcast_objects(shared)  # rank 0's folder: every rank loads the one checkpoint it saves
        if rank == 0:
            _saved_model(point, mine)
        barrier()
        loaded = {name: _loaded(shared[0], world, name) for name in point.implementations}
        barrier()  # rank 0's folder goes when every rank has loaded
    ids = torch.randint(0, 1024, (point.batch, point.seq), generator=torch.Generator().manual_seed(1000 + rank))
    with torch.no_grad():
        logits = {name: model(ids).logits for name, (model, _) in loaded.items()}
    first = logits[point.implementations[0]]
    difference = torch.tensor(max((value - first).abs().max().item() for value in logits.values()))
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    steps: dict[str, list[float]] = {name: [] for name in loaded}
    for round_index in range(repeats + 1):
        for name, (model, optimizer) in loaded.items():
            seconds = slowest_rank_seconds(lambda model=model, optimizer=optimizer: _step(model, optimizer, ids))
            if round_index:
                steps[name].append(seconds)
    if rank:
        return None
    step_ms = {name: statistics.median(values) * 1e3 for name, values in steps.items()}
    record = {"bench": "hf-ep", "config": point.name, "workers": world, "logits_max_difference": difference.item(),
              **{f"step_ms_{name}": value for name, value in step_ms.items()}}
    if "moeflow" in step_ms and "all_to_all" in step_ms:
        record["step_over_moeflow"] = step_ms["all_to_all"] / step_ms["moeflow"]
    return record


def _rank_main(argv: list[str]) -> None:
    import torch.distributed as dist

    from moeflow.bench import grid_rank_main

    def measure(values: dict[str, Any], groups: Any, profile: Any, repeats: int, emit: Any) -> None:
        values["implementations"] = tuple(values["implementations"])
        record = measure_point(dist.get_rank(), dist.get_world_size(), HFEPPoint(**values), repeats)
        if record is not None:
            emit(record)

    grid_rank_main(argv, "hf-ep", measure)


def run_cluster(
    grid: list[HFEPPoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29802, timeout_s: float = 3600,
) -> list[dict[str, Any]]:
    """The grid on the emulated cluster (no calibration: nothing here is planned); rank 0's records."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.hf_ep", "hf-ep", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, calibrate=False)


def run_loopback(grid: list[HFEPPoint], workers: int, repeats: int, emit: Any) -> list[dict[str, Any]]:
    """The grid on ``workers`` local gloo processes (loopback); rank 0's records, each emitted."""
    from moeflow.distributed import run_distributed

    records = []
    for point in grid:
        record = run_distributed(measure_point, workers, point, repeats, timeout_s=3600)[0]
        emit(record)
        records.append(record)
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point: transformers' step time over moeflow's, and the largest logits difference."""
    rows = [r for r in records if r.get("bench") == "hf-ep"]
    return {"summary": "hf-ep", "configs": len(rows),
            "step_over_moeflow": {f"{r['config']} W={r['workers']}": round(r["step_over_moeflow"], 3)
                                  for r in rows if "step_over_moeflow" in r},
            "logits_max_difference": max((r["logits_max_difference"] for r in rows), default=0.0)}


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
