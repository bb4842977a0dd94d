"""Every command's --help, as a user's first try: it prints and exits 0 (issue 61: `moeflow train
--help` crashed on a '%' in a help string, and no test noticed)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from moeflow.cli import MoeflowParser, build_parser


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path under ``parser``, subcommands of subcommands included (``bench layer``)."""
    paths = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.append((*prefix, name))
                paths.extend(_commands(sub, (*prefix, name)))
    return paths


COMMANDS = _commands(build_parser())


def test_the_walk_finds_the_commands_a_user_meets_first() -> None:
    assert {("train",), ("generate",), ("calibrate",), ("bench",), ("bench", "layer"), ("bench", "kernels")} <= set(
        COMMANDS)


@pytest.mark.parametrize("command", [(), *COMMANDS], ids=lambda path: " ".join(path) or "moeflow")
def test_help_prints_and_exits_zero(command: tuple[str, ...]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--help"])
    assert exit_info.value.code == 0 and "usage: moeflow" in out.getvalue()


def test_a_percent_sign_in_help_is_prose_and_argparse_fields_still_expand() -> None:
    parser = MoeflowParser(prog="demo")
    parser.add_argument("--share", default=0.1, help="ragged where 10 % of its slots are empty (default %(default)s)")
    text = parser.format_help()
    assert "10 % of its slots" in text and "(default 0.1)" in text
