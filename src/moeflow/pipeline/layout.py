"""The pipeline schedules moeflow runs, by name, and which stages a rank holds under each (one;
several looped, ``rank + i * P``; or two in a V, ``rank`` and ``2P - 1 - rank``, so the first and
the last stage share a rank). Light: settings read it without importing torch's runtime."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule's name, the stages each rank holds (None: ``stages_per_rank`` of the user's, at
    least two), how they are laid out (``loop`` or ``v``), and whether its runtime pairs one
    micro-batch's forward on one of a rank's stages with another's backward on the other
    (``OVERLAP_F_B``: what :mod:`moeflow.pipeline.overlap` runs side by side)."""

    name: str
    stages_per_rank: int | None
    style: str
    pairs_forward_backward: bool = False

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
    "gpipe": PipelineSchedule("gpipe", 1, "loop"),
    "1f1b": PipelineSchedule("1f1b", 1, "loop"),
    "interleaved": PipelineSchedule("interleaved", None, "loop"),
    "zbv": PipelineSchedule("zbv", 2, "v"),
    "dualpipev": PipelineSchedule("dualpipev", 2, "v", pairs_forward_backward=True),
}


def schedule_named(name: str) -> PipelineSchedule:
    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]
