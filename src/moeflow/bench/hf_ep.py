"""``moeflow bench hf-ep``: transformers' own expert parallelism against moeflow's backend inside
transformers (``ep_implementation="moeflow"``), on the same model, side by side in one run.

Per point: a Qwen3-MoE-like model of random weights (saved by rank 0, loaded by every rank as a
user loads one), each rank its own batch, loaded once per implementation with
``DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation=...)`` (FSDP2 on the dense part, each
rank W-th of the experts) and given AdamW. First the logits of one no-grad forward and the tokens
of a greedy generation, checked equal between the implementations (the largest logits difference
is reported); then, round-robin after a warm-up round, a training step (forward, backward,
optimizer), a prefill (a no-grad forward of the batch) and a decode (8 greedy tokens of one
sequence after a 16-token prompt), one of each per implementation per round, the slowest rank's
medians. ``<phase>_over_moeflow`` > 1: moeflow's backend is faster; ``<phase>_over_train_hf`` > 1:
``moeflow train --hf``'s model is.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from moeflow.progress import Progress

TRAIN_HF = "train_hf"
IMPLEMENTATIONS = ("all_to_all", "moeflow", TRAIN_HF)
"""transformers' own all-to-all, moeflow's backend with its defaults, and ``moeflow train --hf``'s
model: the blocks converted to moeflow's layer with the trainer's settings, the dense part data
parallel with the trainer's gradient synchronisation."""


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
    token_exchange: str = "auto"  # moeflow's (moeflow.hf.configure)
    alltoall: str = "linear"  # moeflow's: linear, 2dh or pairwise (the cluster's node layout)
    pipeline: int | str = "auto"  # the chunks moeflow's backend moves a block's rows in, or searched

    @property
    def name(self) -> str:
        return (f"E{self.num_experts}-k{self.top_k}-M{self.hidden_size}-He{self.moe_hidden}-L{self.layers}"
                f"-T{self.batch * self.seq}-{self.token_exchange}-{self.alltoall}"
                + (f"-d{self.pipeline}" if self.pipeline != 1 else ""))  # unsuffixed: one piece, as before auto


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


class _SyncingAdamW:
    """AdamW after the trainer's gradient synchronisation (replicated gradients averaged, experts'
    scaled), as a ``moeflow train --hf`` step runs it."""

    def __init__(self, trainable: Any, world: int) -> None:
        import torch

        self.trainable, self.world = trainable, world
        self.adamw = torch.optim.AdamW(trainable.parameters(), lr=1e-5)

    def step(self) -> None:
        import torch.distributed as dist

        from moeflow.training.gradients import synchronize_gradients

        synchronize_gradients(self.trainable, self.trainable.expert_parameter_names(), dist.group.WORLD, self.world)
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)


def _trainer_model(folder: str, world: int, point: HFEPPoint) -> tuple[Any, Any]:
    """``moeflow train --hf``'s model (each rank reading its own experts) and its optimizer."""
    import torch
    import torch.distributed as dist

    from moeflow.comm.groups import ParallelGroups
    from moeflow.training import TrainConfig
    from moeflow.training.hf_model import build_hf_model

    config = TrainConfig(hf=folder, batch_size=point.batch, context=point.seq, workers=world)
    trainable = build_hf_model(config, ParallelGroups.from_group(dist.group.WORLD), torch.device("cpu"))
    return trainable.model.train(), _SyncingAdamW(trainable, world)  # in training mode, as the trainer runs it


def _loaded(folder: str, world: int, implementation: str, point: HFEPPoint) -> tuple[Any, Any]:
    import torch
    import transformers
    from transformers.distributed import DistributedConfig

    if implementation == TRAIN_HF:
        return _trainer_model(folder, world, point)

    layout = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation=implementation)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=layout)
    return model.train(), torch.optim.AdamW(model.parameters(), lr=1e-5)  # as transformers' Trainer trains it


def _step(model: Any, optimizer: Any, ids: Any) -> None:
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


DECODE_TOKENS = 8
"""Tokens each rank generates (greedy, one sequence, every rank as many) in the decode phase."""


def _decode(model: Any, ids: Any) -> Any:
    """Greedy tokens of the batch's first sequence after its first 16 tokens."""
    return model.generate(ids[:1, :16], max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS,
                          do_sample=False)


def _phases(ids: Any) -> dict[str, Any]:
    """What each round times, per implementation: a training step, a prefill (a no-grad forward of
    the batch) and a decode (one sequence's greedy tokens after a short prompt)."""
    import torch

    def prefill(model: Any, optimizer: Any) -> None:
        with torch.no_grad():
            model(ids)

    def decode(model: Any, optimizer: Any) -> None:
        with torch.no_grad():
            _decode(model, ids)

    return {"step": lambda model, optimizer: _step(model, optimizer, ids), "prefill": prefill, "decode": decode}


def _loaded_everywhere(point: HFEPPoint, rank: int, world: int) -> dict[str, tuple[Any, Any]]:
    """Each implementation's model and optimizer, from the one checkpoint rank 0 saves."""
    import tempfile

    from moeflow.comm.collectives import barrier, broadcast_objects

    with tempfile.TemporaryDirectory() as mine:
        shared = [mine]
        broadcast_objects(shared)
        if rank == 0:
            _saved_model(point, mine)
        barrier()
        loaded = {name: _loaded(shared[0], world, name, point) for name in point.implementations}
        barrier()  # rank 0's folder goes when every rank has loaded
    return loaded


def _agreement(loaded: dict[str, tuple[Any, Any]], ids: Any) -> tuple[float, bool]:
    """The largest logits difference from the first implementation's, and whether every
    implementation generates its tokens, over all ranks (before any step moves the weights)."""
    import torch

    from moeflow.comm.collectives import reduce_values

    with torch.no_grad():
        logits = [model(ids).logits for model, _ in loaded.values()]
        tokens = [_decode(model, ids) for model, _ in loaded.values()]
    difference = max((value - logits[0]).abs().max().item() for value in logits)
    differs = float(not all(torch.equal(value, tokens[0]) for value in tokens))
    difference, differs = reduce_values([difference, differs], None, "max")  # over the world, on its host device
    return difference, differs == 0


def _settle_search(loaded: dict[str, tuple[Any, Any]], ids: Any) -> list[int] | None:
    """Under ``pipeline="auto"``: enough untimed forwards of the batch for the backend's blocks to
    settle their chunk degree for it (a training step's forward and a prefill share the batch's key);
    each block's choice, as a long run would time it. None without the backend."""
    import torch

    from moeflow.hf.degree_search import SETTLE_CALLS
    from moeflow.hf.expert_parallel import searched_degrees

    if "moeflow" not in loaded:
        return None
    model = loaded["moeflow"][0]
    with torch.no_grad():
        for _ in range(SETTLE_CALLS):
            model(ids)
    return [degree for block in searched_degrees() for key, degree in block.items() if key[1] > 1]  # searched keys


SETTLE_LIMIT = 30
"""Training steps ``moeflow train --hf``'s model may take to settle its plans before the timed rounds."""


def _settle_trainer(loaded: dict[str, tuple[Any, Any]], ids: Any) -> int | None:
    """Training steps of ``moeflow train --hf``'s model until every MoE layer's planner has settled
    (its trials are the start of a run, timed apart: ``plan_source`` in ``metrics.jsonl``), as the
    backend's search is settled first; the steps it took. None without that model."""
    from moeflow.moe.layer import MoELayer
    from moeflow.parallel.online_planner import DECIDED

    if TRAIN_HF not in loaded:
        return None
    model, optimizer = loaded[TRAIN_HF]
    layers = [module for module in model.modules() if isinstance(module, MoELayer)]
    for step in range(1, SETTLE_LIMIT + 1):
        _step(model, optimizer, ids)
        if all(layer.last_stats.plan.source in DECIDED for layer in layers):
            return step
    return SETTLE_LIMIT


def measure_point(
    rank: int, world: int, point: HFEPPoint, repeats: int, topology: Any = None
) -> dict[str, Any] | None:
    """Every rank's part of one point (``topology``: the ranks on nodes, for moeflow's 2DH and
    pairwise all-to-alls); rank 0's record."""
    import torch

    import moeflow.hf
    from moeflow.timing.measure import slowest_rank_seconds

    moeflow.hf.configure(token_exchange=point.token_exchange, alltoall=point.alltoall, topology=topology,
                         pipeline=point.pipeline)
    loaded = _loaded_everywhere(point, rank, world)
    ids = torch.randint(0, 1024, (point.batch, point.seq), generator=torch.Generator().manual_seed(1000 + rank))
    difference, same_tokens = _agreement(loaded, ids)
    degrees = _settle_search(loaded, ids) if point.pipeline == "auto" else None
    settle_steps = _settle_trainer(loaded, ids)
    phases = _phases(ids)
    times: dict[str, list[float]] = {f"{phase}_{name}": [] for phase in phases for name in loaded}
    for round_index in range(repeats + 1):
        for phase, run in phases.items():
            for name, (model, optimizer) in loaded.items():
                seconds = slowest_rank_seconds(lambda run=run, model=model, optimizer=optimizer: run(model, optimizer))
                if round_index:
                    times[f"{phase}_{name}"].append(seconds)
    if rank:
        return None
    median_ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    record = {"bench": "hf-ep", "config": point.name, "workers": world, "logits_max_difference": difference,
              "generated_equal": same_tokens, **{f"{key}_ms": value for key, value in median_ms.items()}}
    if degrees is not None:
        record["moeflow_degrees"] = degrees
    if settle_steps is not None:
        record["train_hf_settle_steps"] = settle_steps
    for name in ("moeflow", TRAIN_HF):
        if {name, "all_to_all"} <= set(point.implementations):
            for phase in phases:
                record[f"{phase}_over_{name}"] = median_ms[f"{phase}_all_to_all"] / median_ms[f"{phase}_{name}"]
    return record


def _rank_main(argv: list[str]) -> None:
    import torch.distributed as dist

    from moeflow.bench import grid_rank_main

    def measure(values: dict[str, Any], groups: Any, profile: Any, repeats: int, emit: Any) -> None:
        values["implementations"] = tuple(values["implementations"])
        record = measure_point(dist.get_rank(), dist.get_world_size(), HFEPPoint(**values), repeats, groups.topology)
        if record is not None:
            emit(record)

    grid_rank_main(argv, "hf-ep", measure)


def run_cluster(
    grid: list[HFEPPoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29802, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """The grid on the emulated cluster (no calibration: nothing here is planned); rank 0's records."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.hf_ep", "hf-ep", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, calibrate=False, progress=progress)


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
    """Per point and phase: transformers' time over moeflow's backend's and over ``train --hf``'s
    model's; the largest logits difference, and whether every point generated the same tokens."""
    rows = [r for r in records if r.get("bench") == "hf-ep"]
    ratios = {f"{phase}_over_{name}": {f"{r['config']} W={r['workers']}": round(r[f"{phase}_over_{name}"], 3)
                                       for r in rows if f"{phase}_over_{name}" in r}
              for name in ("moeflow", TRAIN_HF) for phase in ("step", "prefill", "decode")}
    return {"summary": "hf-ep", "configs": len(rows), **ratios,
            "logits_max_difference": max((r["logits_max_difference"] for r in rows), default=0.0),
            "generated_equal": all(r["generated_equal"] for r in rows)}


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
