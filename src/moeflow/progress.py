"""Progress of long commands: a bar on a terminal, nothing in CI or a log.

The command layer decides whether a person is watching (:func:`wants_progress`: stderr is a
terminal and ``--no-progress`` is not given) and passes ``enabled`` down; library loops report to a
:class:`Progress` they are handed (:class:`Quiet` when none), so they never look at the terminal or
the environment themselves. The bar is tqdm's (items done, rate, time left) on stderr, imported only
when one is drawn, so ``import moeflow`` stays light. While it is drawn, whole lines printed on
stdout (a benchmark's JSON records) are written above it rather than after its text.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any, Protocol, TextIO

SHOW_AFTER_S = 1.0
"""A bar appears once its work has lasted this long: a search or a command that ends sooner stays
as quiet as it is in a log."""


class Progress(Protocol):
    """What a long loop reports to: how many items there are and how many are done."""

    def expect(self, items: int) -> None:
        """``items`` more to do: a search learns the size of its later phases as it goes."""

    def advance(self, items: int = 1) -> None:
        """``items`` more done."""

    def note(self, text: str) -> None:
        """What is being done now (a calibration's phase), shown beside the count."""


class Quiet:
    """A :class:`Progress` that shows nothing: the default of every library loop."""

    def expect(self, items: int) -> None:
        """Nothing to show."""

    def advance(self, items: int = 1) -> None:
        """Nothing to show."""

    def note(self, text: str) -> None:
        """Nothing to show."""


class _Bar:
    """A :class:`Progress` drawn by a tqdm bar."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def expect(self, items: int) -> None:
        self.bar.total = (self.bar.total or 0) + items

    def advance(self, items: int = 1) -> None:
        self.bar.update(items)

    def note(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=_shown(self.bar))


def _shown(bar: Any) -> bool:
    """Whether tqdm has drawn ``bar`` yet (it waits ``delay`` seconds): redrawing it sooner would
    show a bar a short command never needed."""
    return bool(bar.last_print_t >= bar.start_t + bar.delay)


class _LinesAboveBar(io.TextIOBase):
    """stdout while a bar is drawn: each whole line is written with the bar cleared and then drawn
    again below it, so a record never lands on the bar's line; what is written stays the same."""

    def __init__(self, out: TextIO, bar: Any) -> None:
        super().__init__()
        self.out, self.bar, self.pending = out, bar, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, _, self.pending = self.pending.rpartition("\n")
            self._above(lines + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self._above(self.pending)
            self.pending = ""
        self.out.flush()

    def _above(self, text: str) -> None:
        shown = _shown(self.bar)
        if shown:
            self.bar.clear()
        self.out.write(text)
        self.out.flush()
        if shown:
            self.bar.refresh()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.out, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return self.out.isatty()

    def fileno(self) -> int:
        return self.out.fileno()


def wants_progress(stream: Any, requested: bool = True) -> bool:
    """A bar only where a person watches: ``stream`` (the command's stderr) is a terminal and the
    bar is not turned off; CI jobs and logs (redirected output) get none."""
    isatty = getattr(stream, "isatty", None)
    return requested and callable(isatty) and bool(isatty())


@contextlib.contextmanager
def progress_bar(description: str, unit: str, total: int = 0, *, enabled: bool) -> Iterator[Progress]:
    """A :class:`Progress` for one command's loop: tqdm's bar on stderr when ``enabled`` (shown after
    :data:`SHOW_AFTER_S`, closed on the way out), else :class:`Quiet`."""
    if not enabled:
        yield Quiet()
        return
    from tqdm import tqdm

    bar = tqdm(total=total or None, desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True,
               mininterval=0.5, delay=SHOW_AFTER_S)
    lines = _LinesAboveBar(sys.stdout, bar)
    try:
        with contextlib.redirect_stdout(lines):
            yield _Bar(bar)
    finally:
        lines.flush()
        bar.close()
