"""Pipeline schedules priced: each rank's order of forwards and backwards over the stages it holds,
run against the stages' dependencies (a micro-batch's forward after the stage before it, its
backward after the stage after it), with a send between ranks. The step's time and its bubble (the
share of the step a rank waits) follow; for GPipe, 1F1B and Megatron's interleaved 1F1B they are
the closed forms, ``(M + P - 1)(F + B)`` and ``(v M + P - 1)(F + B) / v`` (tests check).

Torch-free, as the rest of :mod:`moeflow.perf`. The orders are those of the schedules of the same
names that :mod:`moeflow.pipeline.schedules` runs (torch's; Megatron's for the interleaved one,
whose warm-up torch takes too).
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class StageAction:
    """One stage's forward or backward of one micro-batch."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class StageTimes:
    """A simulated step: its seconds, and each rank's busy seconds."""

    step_s: float
    busy_s: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """The share of the step the ranks wait, on average."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s)


def stage_orders(schedule: str, pp_size: int, microbatches: int, stages_per_rank: int = 2) -> list[list[StageAction]]:
    """Each ``pp`` rank's actions in the order it runs them under ``schedule`` (``gpipe``, ``1f1b``
    or ``interleaved`` with ``stages_per_rank`` stages per rank, looped: rank r holds r, r + P, ...)."""
    if schedule == "gpipe":
        return [[StageAction(FORWARD, rank, m) for m in range(microbatches)]
                + [StageAction(BACKWARD, rank, m) for m in range(microbatches)] for rank in range(pp_size)]
    if schedule == "1f1b":
        return [_one_forward_one_backward(rank, pp_size, microbatches) for rank in range(pp_size)]
    if schedule == "interleaved":
        return [_interleaved(rank, pp_size, microbatches, stages_per_rank) for rank in range(pp_size)]
    raise ValueError(f"schedule={schedule!r} is not priced here; gpipe, 1f1b and interleaved are")


def _one_forward_one_backward(rank: int, pp_size: int, microbatches: int) -> list[StageAction]:
    warmup = min(pp_size - rank - 1, microbatches)
    order = [StageAction(FORWARD, rank, m) for m in range(warmup)]
    for m in range(microbatches - warmup):
        order += [StageAction(FORWARD, rank, warmup + m), StageAction(BACKWARD, rank, m)]
    return order + [StageAction(BACKWARD, rank, m) for m in range(microbatches - warmup, microbatches)]


def _interleaved(rank: int, pp_size: int, microbatches: int, chunks: int) -> list[StageAction]:
    """Megatron's interleaved 1F1B: the rank's virtual micro-batches (chunk, micro-batch) in groups
    of P, forwards chunk by chunk, backwards from the last chunk; (P - r - 1) x 2 + (v - 1) x P
    forwards before the first backward."""
    total = microbatches * chunks
    if microbatches % pp_size:
        raise ValueError(f"interleaved: microbatches={microbatches} must be a multiple of pp_size={pp_size}")

    def action(kind: str, k: int) -> StageAction:
        chunk = (k // pp_size) % chunks
        chunk = chunks - 1 - chunk if kind == BACKWARD else chunk
        return StageAction(kind, chunk * pp_size + rank, (k // (pp_size * chunks)) * pp_size + k % pp_size)

    warmup = min((pp_size - rank - 1) * 2 + (chunks - 1) * pp_size, total)
    order = [action(FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(FORWARD, warmup + k), action(BACKWARD, k)]
    return order + [action(BACKWARD, k) for k in range(total - warmup, total)]


def simulate_stages(
    orders: list[list[StageAction]], forward_s: float, backward_s: float, send_s: float = 0.0,
) -> StageTimes:
    """Run each rank's ``orders`` in order: an action starts when its rank is free and its input is
    there (``send_s`` later where it comes from another rank); a stage's forward and backward of a
    micro-batch take ``forward_s`` and ``backward_s``."""
    holder = {action.stage: rank for rank, order in enumerate(orders) for action in order}
    last = max(holder)
    done: dict[StageAction, float] = {}
    free, position = [0.0] * len(orders), [0] * len(orders)
    while any(position[rank] < len(order) for rank, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = order[position[rank]]
                ready = _ready(action, done, holder, rank, last, send_s)
                if ready is None:
                    break
                seconds = forward_s if action.kind == FORWARD else backward_s
                free[rank] = done[action] = max(free[rank], ready) + seconds
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the ranks' orders wait on each other: no schedule runs them")
    busy = tuple(sum(forward_s if a.kind == FORWARD else backward_s for a in order) for order in orders)
    return StageTimes(max(free), busy)


def _ready(action: StageAction, done: dict[StageAction, float], holder: dict[int, int], rank: int, last: int,
           send_s: float) -> float | None:
    """When ``action``'s input is on ``rank`` (None: not yet computed)."""
    if action.kind == FORWARD:
        source = StageAction(FORWARD, action.stage - 1, action.microbatch) if action.stage > 0 else None
    elif action.stage == last:
        source = StageAction(FORWARD, action.stage, action.microbatch)  # the loss's gradient, on the last stage
    else:
        source = StageAction(BACKWARD, action.stage + 1, action.microbatch)
    if source is None:
        return 0.0
    if source not in done:
        return None
    return done[source] + (send_s if holder[source.stage] != rank else 0.0)
