"""What a run writes as it goes: ``metrics.jsonl`` (one record per step, per-layer routing and
plans), one step's communication timeline, and reading them back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moeflow.comm.traffic import TimelineEvent
from moeflow.metrics import CsvSink, JsonlSink, MetricsSink, StepHealth, TensorBoardSink
from moeflow.models import TrainableLM
from moeflow.parallel.balance import balance_mode
from moeflow.training.config import TrainConfig

METRICS = "metrics.jsonl"
METRICS_CSV = "metrics.csv"  # --metrics-csv
TENSORBOARD = "tensorboard"  # --tensorboard: the event files' folder
TRAINER_SCALARS = ("loss", "aux_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_s")
"""The step record's numbers the TensorBoard and CSV sinks draw besides the MoE's health."""


PROGRESS = "progress"  # the workers' progress files (moeflow.comm.ledger): what a hang report reads
TIMELINE = "timeline.json"  # one step's communication and compute events (rank 0), for the report


def moe_records(model: TrainableLM) -> list[dict[str, Any]]:
    """Per MoE block, what its last forward routed and how it ran: the load, drops, the plan (a
    trial's cost is its ``region_s``; a settled plan carries its search's ``trial_cost_s``), and
    FasterMoE's shadowed experts with the gain the cost model predicted for them (None: no profile),
    and the load balancing it runs (off, shadowing or redundant slots: ``balance='auto'`` changes it)."""
    records = []
    for index, layer in zip(model.moe_block_indices(), model.moe_layers(), strict=True):
        stats = layer.last_stats
        if stats is None:
            continue
        records.append({
            "block": index, "tokens_per_expert": stats.tokens_per_expert, "dropped": stats.dropped,
            "capacity": stats.capacity, "alltoall": stats.plan.alltoall if stats.plan else None,
            "pipeline_degree": stats.plan.pipeline_degree if stats.plan else None,
            "plan_source": stats.plan.source if stats.plan else None,
            "region_s": stats.timing.total_s if stats.timing.forward_s is not None else None,
            "trial_cost_s": stats.plan.trial_cost_s if stats.plan else None,
            "schedule": stats.plan.schedule if stats.plan else None,
            "r": stats.plan.r if stats.plan else None,
            "shadowed": list(stats.shadowed_experts), "shadow_gain_s": stats.shadow_predicted_gain_s,
            "rank_tokens": list(stats.rank_tokens), "cross_node_rows": stats.cross_node_rows,
            "token_exchange": stats.plan.token_exchange if stats.plan else None,
            "expert_kernel": stats.plan.expert_kernel if stats.plan else None,
            "dedup_saved_bytes": stats.dedup_saved_bytes,
            "balance": balance_mode(layer.schedule),
        })
    return records


def metric_sinks(config: TrainConfig, run_dir: Path, resume_step: int | None) -> list[MetricsSink]:
    """The sinks the run's settings ask for besides ``metrics.jsonl`` (rank 0's)."""
    sinks: list[MetricsSink] = []
    if config.metrics_csv:
        sinks.append(CsvSink(run_dir / METRICS_CSV, resume_step, [f"train/{name}" for name in TRAINER_SCALARS]))
    if config.tensorboard:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD))
    return sinks


def health_fields(health: StepHealth) -> dict[str, Any]:
    """What a step record holds of the monitor's figures: ``health`` (the step's all-to-all share and
    each layer's), and ``alerts`` when one fired first at this step."""
    record = health.record()
    fields = {"health": {"alltoall_share": record["alltoall_share"], "layers": record["layers"]}}
    return {**fields, "alerts": record["alerts"]} if record["alerts"] else fields


def write_sinks(sinks: list[MetricsSink], record: dict[str, Any], health: StepHealth) -> None:
    """A step to the sinks: the trainer's numbers (``train/...``) and the MoE's health."""
    if not sinks:
        return
    scalars = {f"train/{name}": float(record[name]) for name in TRAINER_SCALARS
               if isinstance(record.get(name), int | float) and not isinstance(record.get(name), bool)}
    scalars.update(health.scalars())
    for sink in sinks:
        sink.write(record["step"], scalars, health.loads(), record)


def write_timeline(path: Path, step: int, events: list[TimelineEvent]) -> None:
    """One step's events as [kind, start, stop] in seconds from the step's first event."""
    origin = min((event.start_s for event in events), default=0.0)
    rows = [[e.kind, e.start_s - origin, e.stop_s - origin] for e in sorted(events, key=lambda e: e.start_s)]
    path.write_text(json.dumps({"step": step, "events": rows}))


def metrics_log(run_dir: Path, resume_step: int | None) -> JsonlSink:
    """``metrics.jsonl`` (rank 0's); a resumed run first drops the records after its checkpoint."""
    return JsonlSink(run_dir / METRICS, resume_step)


def iterate_records(run_dir: Path) -> Iterator[dict[str, Any]]:
    path = run_dir / METRICS
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a moeflow run folder?")
    for line in path.read_text().splitlines():
        if line.strip():
            yield json.loads(line)
