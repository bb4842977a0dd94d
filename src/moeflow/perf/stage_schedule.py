"""Pipeline schedules priced: each rank's order of forwards and backwards over the stages it holds,
run against the stages' dependencies (a micro-batch's forward after the stage before it, its
backward after the stage after it, a zero-bubble weight gradient after its input gradient), with a
send between ranks. The step's time and its bubble (the share of the step a rank waits) follow;
for GPipe, 1F1B and Megatron's interleaved 1F1B they are the closed forms, ``(M + P - 1)(F + B)``
and ``(v M + P - 1)(F + B) / v``, and for DualPipeV DeepSeek's published bubble,
``(S/2 - 1)(F&B + B - 3W)`` over ``S = 2P`` stages (tests check). A DualPipeV pair (``OVERLAP_F_B``)
takes ``paired_s``: ``F + B`` run one after the other, less what the overlap hides.

Torch-free, as the rest of :mod:`moeflow.perf`. The orders are those of the schedules of the same
names that :mod:`moeflow.pipeline.schedules` runs (torch's, ported; a test compares them; Megatron's
for the interleaved one, whose warm-up torch takes too).
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, INPUT, WEIGHT = "F", "B", "I", "W"
"""A stage's forward; its full backward; a zero-bubble backward's input-gradient and weight-gradient halves."""


@dataclass(frozen=True)
class StageAction:
    """One stage's forward or backward of one micro-batch."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class Paired:
    """A forward and a backward (on the rank's other stage) run together: DualPipeV's ``OVERLAP_F_B``."""

    forward: StageAction
    backward: StageAction


OrderItem = StageAction | Paired


@dataclass(frozen=True)
class StageCosts:
    """What a stage's actions take: a forward, a full backward (of which ``weight_s`` is the weight
    gradient, zero-bubble's W), and its forward paired with a backward on the rank's other stage
    (None: the two one after the other)."""

    forward_s: float
    backward_s: float
    weight_s: float = 0.0
    paired_s: float | None = None

    def seconds(self, item: OrderItem) -> float:
        if isinstance(item, Paired):
            return self.forward_s + self.backward_s if self.paired_s is None else self.paired_s
        return {FORWARD: self.forward_s, BACKWARD: self.backward_s, INPUT: self.backward_s - self.weight_s,
                WEIGHT: self.weight_s}[item.kind]


@dataclass(frozen=True)
class StageTimes:
    """A simulated step: its seconds, and each rank's busy seconds."""

    step_s: float
    busy_s: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """The share of the step the ranks wait, on average."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s)


def stage_orders(schedule: str, pp_size: int, microbatches: int, stages_per_rank: int = 2) -> list[list[OrderItem]]:
    """Each ``pp`` rank's actions in the order it runs them under ``schedule``: ``gpipe``, ``1f1b``,
    ``interleaved`` with ``stages_per_rank`` stages per rank (looped: rank r holds r, r + P, ...),
    or a V (rank r holds r and 2P - 1 - r): ``zbv`` or ``dualpipev``."""
    if schedule == "gpipe":
        return [[StageAction(FORWARD, rank, m) for m in range(microbatches)]
                + [StageAction(BACKWARD, rank, m) for m in range(microbatches)] for rank in range(pp_size)]
    if schedule == "1f1b":
        return [_one_forward_one_backward(rank, pp_size, microbatches) for rank in range(pp_size)]
    if schedule == "interleaved":
        return [_interleaved(rank, pp_size, microbatches, stages_per_rank) for rank in range(pp_size)]
    if schedule == "zbv":
        return [_zero_bubble_v(rank, pp_size, microbatches) for rank in range(pp_size)]
    if schedule == "dualpipev":
        return [_dualpipe_v(rank, pp_size, microbatches) for rank in range(pp_size)]
    raise ValueError(f"schedule={schedule!r} is not priced; gpipe, 1f1b, interleaved, zbv and dualpipev are")


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


def _zero_bubble_v(rank: int, pp_size: int, microbatches: int) -> list[OrderItem]:
    """torch's ZBV zero bubble: rank r's stages r and 2P - 1 - r, forwards to fill the V, then a
    forward, input gradient and weight gradient of each stage in turn, the weights last."""
    chunk0, chunk1, total = rank, 2 * pp_size - 1 - rank, max(2 * pp_size - 1, microbatches)
    order: list[StageAction] = []
    counts = dict.fromkeys(((kind, stage) for kind in (FORWARD, INPUT, WEIGHT) for stage in (chunk0, chunk1)), 0)

    def run(kind: str, stage: int) -> None:
        order.append(StageAction(kind, stage, counts[(kind, stage)]))
        counts[(kind, stage)] += 1

    for _ in range(2 * (pp_size - rank) - 1):
        run(FORWARD, chunk0)
    for _ in range(rank):
        run(FORWARD, chunk1)
        run(FORWARD, chunk0)
    for _ in range(pp_size - rank):
        run(FORWARD, chunk1)
        run(INPUT, chunk1)
        run(WEIGHT, chunk1)
    while counts[(FORWARD, chunk1)] < counts[(FORWARD, chunk0)] or counts[(FORWARD, chunk0)] < total:
        if counts[(FORWARD, chunk0)] < total:
            run(FORWARD, chunk0)
        run(INPUT, chunk0)
        run(WEIGHT, chunk0)
        run(FORWARD, chunk1)
        run(INPUT, chunk1)
        run(WEIGHT, chunk1)
    for _ in range(rank):
        run(INPUT, chunk0)
        run(INPUT, chunk1)
    for _ in range(pp_size - rank):
        run(INPUT, chunk0)
        run(WEIGHT, chunk0)
    for stage in (chunk1, chunk0):
        while counts[(WEIGHT, stage)] < counts[(INPUT, stage)]:
            run(WEIGHT, stage)
    return [action for action in order if action.microbatch < microbatches]


def _dualpipe_v(rank: int, pp_size: int, microbatches: int) -> list[OrderItem]:
    """torch's DualPipeV (DeepSeek's, cut in half): rank r's stages r and 2P - 1 - r; in its steady
    phase a forward of one stage paired with a backward of the other (:class:`Paired`); zero-bubble
    input and weight gradients at the ends."""
    if microbatches < 2 * pp_size:
        raise ValueError(f"dualpipev: microbatches={microbatches} must be at least the {2 * pp_size} stages")
    chunk0, chunk1 = rank, 2 * pp_size - 1 - rank
    order: list[OrderItem] = []
    counts: dict[tuple[str, int], int] = {}
    weights: list[StageAction] = []  # input gradients whose weight gradient is still to run

    def action(kind: str, stage: int) -> StageAction:
        key = (INPUT if kind in (BACKWARD, INPUT) else kind, stage)
        index = counts.get(key, 0)
        counts[key] = index + 1
        if kind == INPUT:
            weights.append(StageAction(WEIGHT, stage, index))
        return StageAction(kind, stage, index)

    def pending_weight() -> None:
        if weights:
            order.append(weights.pop(0))

    order += [action(FORWARD, chunk0) for _ in range((pp_size - rank - 1) * 2)]
    for _ in range(rank + 1):
        order += [action(FORWARD, chunk0), action(FORWARD, chunk1)]
    for _ in range(pp_size - rank - 1):
        order.append(action(INPUT, chunk1))
        pending_weight()
        order.append(action(FORWARD, chunk1))
    for step in range(microbatches - pp_size * 2 + rank + 1):
        if step == 0 and rank == pp_size - 1:  # torch runs this first pair apart, for a smaller bubble
            order += [action(FORWARD, chunk0), action(BACKWARD, chunk1)]
        else:
            order.append(Paired(action(FORWARD, chunk0), action(BACKWARD, chunk1)))
        order.append(Paired(action(FORWARD, chunk1), action(BACKWARD, chunk0)))
    for _ in range(pp_size - rank - 1):
        order.append(action(BACKWARD, chunk1))
        order.append(Paired(action(FORWARD, chunk1), action(BACKWARD, chunk0)))
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        order.append(action(INPUT if split else BACKWARD, chunk1))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        order.append(action(INPUT if split else BACKWARD, chunk0))
    for _ in range(pp_size - rank - 1):
        pending_weight()
        order.append(action(INPUT if split else BACKWARD, chunk0))
    for _ in range(rank + 1):
        pending_weight()
    return order


def simulate_stages(
    orders: list[list[OrderItem]], forward_s: float, backward_s: float, send_s: float = 0.0, weight_s: float = 0.0,
    paired_s: float | None = None,
) -> StageTimes:
    """Run each rank's ``orders`` with every stage's actions at the same costs: what
    :class:`StageCosts` says of ``forward_s``, ``backward_s``, ``weight_s`` and ``paired_s``
    (:func:`simulate_stage_costs`)."""
    stages = 1 + max(action.stage for order in orders for item in order for action in actions_of(item))
    return simulate_stage_costs(orders, [StageCosts(forward_s, backward_s, weight_s, paired_s)] * stages, send_s)


def simulate_stage_costs(orders: list[list[OrderItem]], costs: list[StageCosts], send_s: float = 0.0) -> StageTimes:
    """Run each rank's ``orders`` in order: an action starts when its rank is free and its input is
    there (``send_s`` later where it comes from another rank) and takes what ``costs[stage]`` says
    (a pair: its forward's stage's ``paired_s``), so that stages of unequal cost (the first holds
    the embedding, the last the LM head) are priced as measured."""
    holder = {action.stage: rank for rank, order in enumerate(orders) for item in order for action in actions_of(item)}
    if len(costs) <= max(holder):
        raise ValueError(f"costs has {len(costs)} stages; the orders run {max(holder) + 1}")
    last = max(holder)
    done: dict[tuple[str, int, int], float] = {}
    free, position = [0.0] * len(orders), [0] * len(orders)
    while any(position[rank] < len(order) for rank, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                item = order[position[rank]]
                inputs = [_ready(action, done, holder, rank, last, send_s) for action in actions_of(item)]
                if any(ready is None for ready in inputs):
                    break
                free[rank] = max(free[rank], *inputs) + _seconds(item, costs)  # type: ignore[type-var]
                for action in actions_of(item):
                    done[_output(action)] = free[rank]
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the ranks' orders wait on each other: no schedule runs them")
    busy = tuple(sum(_seconds(item, costs) for item in order) for order in orders)
    return StageTimes(max(free), busy)


def _seconds(item: OrderItem, costs: list[StageCosts]) -> float:
    return costs[actions_of(item)[0].stage].seconds(item)


def actions_of(item: OrderItem) -> tuple[StageAction, ...]:
    """The stage actions an order item runs: one, or a pair's two."""
    return (item.forward, item.backward) if isinstance(item, Paired) else (item,)


def _output(action: StageAction) -> tuple[str, int, int]:
    """What ``action`` makes: a forward's activation (F), an input gradient (G: a full backward's
    or zero-bubble's I), a weight gradient (W)."""
    kind = {FORWARD: FORWARD, BACKWARD: "G", INPUT: "G", WEIGHT: WEIGHT}[action.kind]
    return kind, action.stage, action.microbatch


def _ready(action: StageAction, done: dict[tuple[str, int, int], float], holder: dict[int, int], rank: int,
           last: int, send_s: float) -> float | None:
    """When ``action``'s input is on ``rank`` (None: not yet computed)."""
    stage, microbatch = action.stage, action.microbatch
    if action.kind == FORWARD:
        source = (FORWARD, stage - 1, microbatch) if stage > 0 else None
    elif action.kind == WEIGHT:
        source = ("G", stage, microbatch)  # after its input gradient, on the same rank
    elif stage == last:
        source = (FORWARD, stage, microbatch)  # the loss's gradient, on the last stage
    else:
        source = ("G", stage + 1, microbatch)
    if source is None:
        return 0.0
    if source not in done:
        return None
    return done[source] + (send_s if holder[source[1]] != rank else 0.0)
