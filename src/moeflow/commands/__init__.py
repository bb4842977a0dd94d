"""The ``moeflow`` subcommands, one module each: ``add_parser(subparsers)`` registers the parser
and sets ``func`` to the function that runs it. Heavy imports happen inside the run functions, so
``moeflow --help`` stays fast."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def fail(command: str, error: object) -> SystemExit:
    """The exit of a command that cannot go on: its name and what to fix, no traceback."""
    return SystemExit(f"moeflow {command}: {error}")


def require_testbed(command: str) -> None:
    """Cluster commands need root and the kernel's network tools: say so before anything starts."""
    from moeflow.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise fail(command, reason)
