"""The pipeline schedules moeflow runs, each one of ``torch.distributed.pipelining``'s, and which
stages a rank holds under it (one; several looped, ``rank + i * P``; or two in a V, ``rank`` and
``2P - 1 - rank``, so the first and the last stage share a rank)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule's name, torch's class, the stages each rank holds (None: ``stages_per_rank``
    of the user's, at least two) and how they are laid out (``loop`` or ``v``)."""

    name: str
    runtime: type
    stages_per_rank: int | None
    style: str

    def stage_indices(self, pp_rank: int, pp_size: int, stages_per_rank: int = 2) -> list[int]:
        """The stage indices ``pp_rank`` holds, in the order its schedule takes them."""
        per_rank = self.stages_per_rank or stages_per_rank
        if self.style == "v":
            return [pp_rank, 2 * pp_size - 1 - pp_rank]
        return [pp_rank + i * pp_size for i in range(per_rank)]

    def num_stages(self, pp_size: int, stages_per_rank: int = 2) -> int:
        return pp_size * (self.stages_per_rank or stages_per_rank)

    def rank_of(self, stage: int, pp_size: int, stages_per_rank: int = 2) -> int:
        """The ``pp`` rank that holds ``stage``."""
        return next(rank for rank in range(pp_size) if stage in self.stage_indices(rank, pp_size, stages_per_rank))


SCHEDULES = {
    "gpipe": PipelineSchedule("gpipe", ScheduleGPipe, 1, "loop"),
    "1f1b": PipelineSchedule("1f1b", Schedule1F1B, 1, "loop"),
    "interleaved": PipelineSchedule("interleaved", ScheduleInterleaved1F1B, None, "loop"),
    "zbv": PipelineSchedule("zbv", ScheduleZBVZeroBubble, 2, "v"),
    "dualpipev": PipelineSchedule("dualpipev", ScheduleDualPipeV, 2, "v"),
}


def schedule_named(name: str) -> PipelineSchedule:
    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def build_runtime(
    schedule: PipelineSchedule, stages: Sequence[PipelineStage], microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> object:
    """torch's schedule over this rank's ``stages``, ``microbatches`` per step, ``loss_fn`` on the
    last stage's output. It leaves the gradients unscaled: torch scales each stage's, which would
    divide a parameter two stages share (a V schedule's tied embedding) twice; the caller scales
    each parameter once (:meth:`moeflow.pipeline.build.Pipeline.step`)."""
    if schedule.stages_per_rank == 1:
        return schedule.runtime(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule.runtime(list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
