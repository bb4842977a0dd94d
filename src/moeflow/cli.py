"""The ``moeflow`` command line: one module per subcommand in :mod:`moeflow.commands`, each
registering its parser with ``set_defaults(func=...)``; subcommands import what they need lazily,
so ``--help`` is fast. ``moeflow --help`` lists the subcommands by group (:data:`COMMAND_GROUPS`)."""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from moeflow.commands import bench, calibrate, cluster, export, generate, plan, profile_routing, simulate, train

COMMANDS = (train, generate, export, profile_routing, bench, calibrate, plan, simulate, cluster)

COMMAND_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("run", "train a model, generate with it and export it", ("train", "generate", "export")),
    ("inspect", "look into a finished run or a model", ("report", "profile-routing")),
    ("plan", "measure a machine, predict and simulate plans", ("calibrate", "plan", "simulate")),
    ("benchmark", "measure moeflow against baselines and floors", ("bench",)),
    ("cluster", "an emulated multi-node cluster on this machine (needs root)", ("launch", "cluster")),
)
"""Every subcommand in exactly one group: (group, what its commands are for, the commands in the
order listed). ``build_parser`` refuses a registered subcommand that no group names."""


class _Commands:
    """The subparsers action as the command modules see it: records each command's one-line help
    for the grouped listing (and keeps it out of argparse's flat one)."""

    def __init__(self, action: Any) -> None:
        self.action = action
        self.help: dict[str, str] = {}

    def add_parser(self, name: str, *, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        self.help[name] = help
        return self.action.add_parser(name, **kwargs)


def grouped_commands(helps: dict[str, str], width: int | None = None) -> str:
    """The subcommands by group, each with its help, wrapped to ``width`` columns."""
    registered, grouped = set(helps), [name for _, _, names in COMMAND_GROUPS for name in names]
    if len(grouped) != len(set(grouped)):
        raise RuntimeError(f"a subcommand is in several groups of moeflow.cli.COMMAND_GROUPS: {grouped}")
    if set(grouped) != registered:
        raise RuntimeError(
            "every subcommand needs exactly one group in moeflow.cli.COMMAND_GROUPS: "
            f"ungrouped {sorted(registered - set(grouped))}, not registered {sorted(set(grouped) - registered)}"
        )
    width = width or max(60, min(shutil.get_terminal_size().columns - 2, 100))
    column = 4 + max(len(name) for name in registered) + 2
    lines = ["commands:"]
    for group, purpose, names in COMMAND_GROUPS:
        lines.append(f"  {group}: {purpose}")
        for name in names:
            text = textwrap.wrap(helps[name], width - column) or [""]
            lines.append(f"    {name:<{column - 6}}  {text[0]}")
            lines += [" " * column + rest for rest in text[1:]]
    lines.append("")
    lines.append("Run 'moeflow COMMAND --help' for a command's options.")
    return "\n".join(lines)


class _PercentSafeHelp(argparse.HelpFormatter):
    """Help text is prose: a lone '%' ("10 % of its slots") is a percent sign, not a format field
    (argparse expands help with %-formatting, and "% o" crashed ``moeflow train --help``). Only
    argparse's own ``%(name)s`` fields are expanded."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        return None if text is None else re.sub(r"%(?!\()", "%%", text)


class MoeflowParser(argparse.ArgumentParser):
    """Every moeflow parser and subparser (subparsers take their parent's class): percent-safe help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _PercentSafeHelp)
        super().__init__(*args, **kwargs)


class _RootHelp(_PercentSafeHelp, argparse.RawDescriptionHelpFormatter):
    """The top level's: its epilog (the grouped command list) is laid out already."""


def build_parser() -> argparse.ArgumentParser:
    parser = MoeflowParser(prog="moeflow", description="Fast distributed Mixture-of-Experts training and inference.",
                           formatter_class=_RootHelp)
    commands = _Commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                               help="the subcommand to run (listed below by group)"))
    for command in COMMANDS:
        command.add_parser(commands)
    parser.epilog = grouped_commands(commands.help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import os

    from moeflow.runtime import tune_cpu_allocator, tuning_requested

    args = build_parser().parse_args(argv)
    tune_cpu_allocator(tuning_requested(os.environ))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
