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

from moeflow.pipeline.layout import SCHEDULES, PipelineSchedule

RUNTIMES: dict[str, type] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV,
}
assert set(RUNTIMES) == set(SCHEDULES)


def build_runtime(
    schedule: PipelineSchedule, stages: Sequence[PipelineStage], microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> object:
    """torch's schedule over this rank's ``stages``, ``microbatches`` per step, ``loss_fn`` on the
    last stage's output. It leaves the gradients unscaled: torch scales each stage's, which would
    divide a parameter two stages share (a V schedule's tied embedding) twice; the caller scales
    each parameter once (:meth:`moeflow.pipeline.build.Pipeline.step`)."""
    runtime = RUNTIMES[schedule.name]
    if schedule.stages_per_rank == 1:
        return runtime(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return runtime(list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
