"""Where experts live (:class:`ExpertPlacement`) and how an expert block runs over ranks
(:class:`ParallelSchedule`)."""

from moeflow.parallel.placement import ExpertPlacement, ExpertShard, expert_kind

__all__ = ["ExpertPlacement", "ExpertShard", "expert_kind"]
