"""The trainer's pipeline settings (``--pp-size``, ``--pp-schedule``, ``--microbatches``), checked
before any worker starts: the layout must fit the workers and the model, and the settings the
pipelined trainer does not run yet are refused by name."""

from __future__ import annotations

from typing import Any, Protocol

from moeflow.config import require_positive_int
from moeflow.pipeline.layout import schedule_named


class PipelineSettings(Protocol):
    """What the checks read of a :class:`~moeflow.training.config.TrainConfig` (which calls them)."""

    pp_size: int
    pp_schedule: str
    microbatches: int | None
    workers: int
    layers: int
    batch_size: int

NOT_WITH_PIPELINE: dict[str, Any] = {
    "hf": None, "mp_size": 1, "esp_size": None, "expert_packing": "off", "redundant_experts": 0,
    "grad_sync": "after", "dtype": "fp32", "shadowing": "off", "balance": "fixed", "profile": None,
}
"""Settings a pipelined run keeps at these values: the pipelined trainer does not run the others yet."""


def pipeline_microbatches(config: PipelineSettings) -> int:
    """A step's micro-batches: ``--microbatches``, or the schedule's stage count (the fewest that
    keep every stage busy, and the fewest torch's 1F1B and DualPipeV take)."""
    return config.microbatches or schedule_named(config.pp_schedule).num_stages(config.pp_size)


def check_pipeline(config: PipelineSettings) -> None:
    require_positive_int("pp_size", config.pp_size)
    layout = schedule_named(config.pp_schedule)
    if config.pp_size == 1:
        if config.microbatches is not None:
            raise ValueError("--microbatches splits a pipelined step: set --pp-size > 1 too, or drop --microbatches")
        return
    if config.workers % config.pp_size:
        raise ValueError(f"workers={config.workers} is not a multiple of pp_size={config.pp_size}: every pipeline "
                         "stage runs on workers / pp-size workers")
    stages = layout.num_stages(config.pp_size)
    if config.layers < stages:
        raise ValueError(f"--pp-schedule {config.pp_schedule} over pp_size={config.pp_size} makes {stages} stages and "
                         f"the model has layers={config.layers}: use more --layers or a smaller --pp-size")
    if config.microbatches is not None:
        require_positive_int("microbatches", config.microbatches)
    microbatches = pipeline_microbatches(config)
    if microbatches < stages or config.batch_size % microbatches:
        raise ValueError(f"microbatches={microbatches} must be at least the {stages} stages of --pp-schedule "
                         f"{config.pp_schedule} and divide batch_size={config.batch_size}: set --microbatches "
                         "and --batch-size to fit")
    for name, value in NOT_WITH_PIPELINE.items():
        if getattr(config, name) != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {getattr(config, name)} does not run with --pp-size yet: drop {flag} "
                             f"(it keeps {value!r}) or run without --pp-size")
