"""Wall-clock time per named phase of a training step, forward and backward together.

The forward is timed directly. The backward is timed with two identity autograd nodes around the
phase: the gradient reaches the one at the phase's output when the phase's backward starts and the
one at its input when it ends (the CPU autograd engine runs one node at a time, so nothing else
runs in between). On GPU the times are host times; synchronize before reading them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd.function import FunctionCtx


class PhaseClock:
    """Accumulates seconds per phase until :meth:`reset`. Disabled, :meth:`around` is a plain call."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._started: dict[tuple[str, str], float] = {}

    def reset(self) -> None:
        self.seconds.clear()
        self._started.clear()

    def around(self, name: str, x: torch.Tensor, phase: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``phase(x)``, with its forward and backward time added to ``seconds[name]``."""
        if not self.enabled:
            return phase(x)
        inside = _Boundary.apply(x, self, name, True)
        return _Boundary.apply(phase(inside), self, name, False)

    def _start(self, name: str, direction: str) -> None:
        self._started[(name, direction)] = time.perf_counter()

    def _stop(self, name: str, direction: str) -> None:
        started = self._started.pop((name, direction), None)
        if started is not None:
            self.seconds[name] += time.perf_counter() - started


class _Boundary(torch.autograd.Function):
    """Identity that marks where a phase begins (``entering``) or ends, in both directions."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, clock: PhaseClock, name: str, entering: bool) -> torch.Tensor:
        ctx.clock, ctx.name, ctx.entering = clock, name, entering
        (clock._start if entering else clock._stop)(name, "forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        (ctx.clock._stop if ctx.entering else ctx.clock._start)(ctx.name, "backward")
        return grad, None, None, None
