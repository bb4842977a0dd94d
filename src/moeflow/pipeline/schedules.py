"""Each pipeline schedule's runtime: one of ``torch.distributed.pipelining``'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import OVERLAP_F_B

from moeflow.pipeline.layout import SCHEDULES, PipelineSchedule
from moeflow.pipeline.overlap import run_side_by_side

RUNTIMES: dict[str, type] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV,
}
assert set(RUNTIMES) == set(SCHEDULES)


def build_runtime(
    schedule: PipelineSchedule, stages: Sequence[PipelineStage], microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], overlap: bool = False,
) -> object:
    """torch's schedule over this rank's ``stages``, ``microbatches`` per step, ``loss_fn`` on the
    last stage's output; ``overlap``: its paired forwards and backwards run side by side
    (:mod:`moeflow.pipeline.overlap`), else one after the other. It leaves the gradients unscaled:
    torch scales each stage's, which would divide a parameter two stages share (a V schedule's tied
    embedding) twice; the caller scales each parameter once (:meth:`moeflow.pipeline.build.Pipeline.step`)."""
    runtime_type = RUNTIMES[schedule.name]
    held = stages[0] if schedule.stages_per_rank == 1 else list(stages)
    runtime = runtime_type(held, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    if overlap:
        runtime.register_custom_function(OVERLAP_F_B, run_side_by_side)
    return runtime
