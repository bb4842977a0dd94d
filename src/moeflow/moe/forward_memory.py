"""What a layer keeps of its last forwards, so that the training tools people use work on it.

Activation checkpointing runs a forward again inside the backward (the *recompute*): that run
must repeat its forward exactly, or the saved tensors differ (the non-reentrant mode refuses
them) and the gradients belong to another computation. Two of the layer's choices change from
call to call: the planner's plan (it times a different candidate at each call while it searches)
and the loss-free balancing bias (each training forward moves it). So the layer keeps the plan
each region shape last ran and the bias each forward routed with, and a recompute takes them
instead of deciding again; it also counts nothing twice (no bias update, no statistics).

``aux_loss`` stays a tensor of the last graph, which ``copy.deepcopy`` cannot copy (an EMA or
teacher copy of the model taken after a forward): :class:`GraphValue` copies its value alone.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moeflow.core.stats import RoutingStats
from moeflow.parallel.dispatchers.protocol import ForwardRecord

#: Plans and biases a recompute can find: enough for a layer called this often in one step.
KEPT = 8


def recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recompute (both
    modes recompute in the backward; nothing else runs a layer's forward there). A compiled
    forward is never rerun that way (the compiler recomputes in its own graph), and the check
    would break its graph."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class GraphValue:
    """A tensor of the last forward's graph kept for reading; a deepcopy copies the value alone."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, object]) -> GraphValue:
        return GraphValue(self.value.detach().clone())


@dataclass
class LastForward:
    """What a layer's last forward leaves for its caller to read, in a plain object written every
    forward: an ``nn.Module`` attribute write costs about 10 µs, and a one-token forward made three."""

    aux_loss: GraphValue
    stats: RoutingStats | Callable[[], RoutingStats] | None = None  # a callable: computed on first read
    checked_data_parallel: int | None = None  # the data-parallel wrapper already checked (its id)
    gather_bucket: int = 0  # tokens per rank the next load agreement carries (moeflow.parallel.agreement)


class ForwardMemory:
    """One record per forward, latest last: a recompute takes the latest record not yet taken,
    since recomputes run in the backward, in reverse order of their forwards. (A layer whose calls
    in one step are only partly checkpointed would hand a recompute a later call's record.) A
    pipeline's stage names its calls instead (:meth:`call`): its micro-batches' backwards run in
    their forwards' order, and a backward split in two (zero-bubble) recomputes twice."""

    def __init__(self) -> None:
        self._records: deque[ForwardRecord] = deque(maxlen=KEPT)
        self._named: OrderedDict[int, ForwardRecord] = OrderedDict()
        self._name: int | None = None
        self._kept_named = KEPT

    @contextlib.contextmanager
    def call(self, name: int, kept: int) -> Iterator[None]:
        """Within: the forward named ``name`` (its recompute repeats the name), its record kept
        under it with the ``kept`` latest names' (one step's calls at least)."""
        self._name, self._kept_named = name, max(KEPT, kept)
        try:
            yield
        finally:
            self._name = None

    def start(self, recompute: bool, moving_bias: torch.Tensor | None) -> ForwardRecord:
        """A forward's record, kept (``moving_bias``: the bias this forward will move, copied as
        it routes with it); a recompute's is its forward's, taken (an empty one if none is kept)."""
        if self._name is not None:
            return self._start_named(recompute, moving_bias)
        if recompute:
            return self._records.pop() if self._records else ForwardRecord()
        record = ForwardRecord(None if moving_bias is None else moving_bias.clone())
        self._records.append(record)
        return record

    def _start_named(self, recompute: bool, moving_bias: torch.Tensor | None) -> ForwardRecord:
        """:meth:`start` for a named call: a recompute reads its forward's record (and may again)."""
        assert self._name is not None
        if recompute:
            return self._named.get(self._name, ForwardRecord())
        record = self._named[self._name] = ForwardRecord(None if moving_bias is None else moving_bias.clone())
        while len(self._named) > self._kept_named:
            self._named.popitem(last=False)
        return record

    @staticmethod
    @contextlib.contextmanager
    def routing_bias(record: ForwardRecord, bias: torch.Tensor) -> Iterator[None]:
        """Within a recompute: ``bias`` as its forward routed with it (the forward moved it after)."""
        if record.bias is None:
            yield
            return
        current = bias.clone()
        bias.copy_(record.bias)
        try:
            yield
        finally:
            bias.copy_(current)
