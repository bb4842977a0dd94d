"""The ``moeflow`` subcommands, one module each: ``add_parser(subparsers)`` registers the parser
and sets ``func`` to the function that runs it. Heavy imports happen inside the run functions, so
``moeflow --help`` stays fast."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from typing import Any


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


class RenamedFlag(argparse.Action):
    """An old spelling of a flag: stores into the new flag's destination and says the new name
    (a FutureWarning), so scripts written for the old name keep working."""

    def __init__(self, option_strings: Sequence[str], dest: str, renamed_to: str = "", **kwargs: Any) -> None:
        self.renamed_to = renamed_to
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warnings.warn(f"{option_string} is renamed {self.renamed_to}; the old spelling reads as the same setting",
                      FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def add_renamed_flag(parser: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    """Accept ``old`` as a deprecated spelling of the flag ``new`` (same type and nargs as ``new``'s)."""
    dest = new.lstrip("-").replace("-", "_")
    parser.add_argument(old, dest=dest, action=RenamedFlag, renamed_to=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)


def fail(command: str, error: object) -> SystemExit:
    """The exit of a command that cannot go on: its name and what to fix, no traceback."""
    return SystemExit(f"moeflow {command}: {error}")


def require_testbed(command: str) -> None:
    """Cluster commands need root and the kernel's network tools: say so before anything starts."""
    from moeflow.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise fail(command, reason)


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """``--no-progress`` on a long command: its bar is drawn only on a terminal anyway."""
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar on stderr (none is drawn when stderr is not a terminal: CI, a log)")


def show_progress(args: argparse.Namespace) -> bool:
    """Whether this command draws a progress bar: a person watches stderr and did not turn it off."""
    import sys

    from moeflow.progress import wants_progress

    return wants_progress(sys.stderr, getattr(args, "progress", True))
