"""Library code never reads the environment: entry points (the CLI, the launchers, the benchmark
drivers) read it once and pass what they found in. Tested on the source, so a new reader fails
here rather than in a user's surprised job."""

from __future__ import annotations

import ast
from pathlib import Path

import moeflow

SOURCE = Path(moeflow.__file__).parent
ENTRY_POINTS = ("cli.py", "__main__.py", "commands/", "training/launch.py", "distributed.py",
                "testbed/", "bench/")


def _reads_environment(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        reader = isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv", "environb", "putenv"}
        if reader and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for alias in node.names if alias.name in {"environ", "getenv"}]
    return sorted(lines)


def test_library_modules_do_not_read_the_environment() -> None:
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE).as_posix()
        if relative.startswith(ENTRY_POINTS):
            continue
        offenders += [f"{relative}:{line}" for line in _reads_environment(ast.parse(path.read_text()))]
    assert not offenders, f"library modules read the environment: {offenders}"


def test_the_check_sees_a_reader() -> None:
    assert _reads_environment(ast.parse("import os\nx = os.environ.get('A')\ny = os.getenv('B')")) == [2, 3]
