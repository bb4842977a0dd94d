"""Which blocks each pipeline stage holds: an even split, or the sizes a user gives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageSplit:
    """The blocks of each stage, by stage index (consecutive, every block in exactly one stage)."""

    blocks: tuple[range, ...]

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    @staticmethod
    def of(layers: int, stages: int, sizes: Sequence[int] | None = None) -> StageSplit:
        """``layers`` blocks over ``stages`` stages: ``sizes`` blocks each, or as even as they go
        (the earlier stages take one more; the last also runs the head and the loss)."""
        if stages < 1 or layers < stages:
            raise ValueError(f"pipeline: {stages} stages need at least one block each and the model has {layers}; "
                             "use fewer stages (pp_size x stages per rank) or a deeper model")
        if sizes is None:
            base, extra = divmod(layers, stages)
            sizes = [base + (1 if stage < extra else 0) for stage in range(stages)]
        elif len(sizes) != stages or sum(sizes) != layers or min(sizes) < 1:
            raise ValueError(f"pipeline split {list(sizes)} must give each of the {stages} stages at least one "
                             f"block and {layers} blocks in all")
        starts = [sum(sizes[:stage]) for stage in range(stages)]
        return StageSplit(tuple(range(start, start + size) for start, size in zip(starts, sizes, strict=True)))
