"""One word, one meaning: the renames of the glossary hold in the source.

``docs/design/glossary.md`` lists every rename in its last table; no old name there is defined
anywhere in ``src/moeflow`` again (its moved module paths live only in ``moeflow.moved``, which
keeps them importable for one release), and a slot map is never a ``plan``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import moeflow
from moeflow.moved import MOVED

SOURCE = Path(moeflow.__file__).parent
GLOSSARY = Path(__file__).parent.parent / "docs" / "design" / "glossary.md"


def old_names(page: str) -> set[str]:
    """The backticked names of the renames table's first column."""
    table = page.split("## Renames", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def defined_names(root: Path) -> set[str]:
    """Every function, class, method and module-level assignment defined under ``root``."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return names


def test_no_old_name_is_defined_again() -> None:
    identifiers = {name for name in old_names(GLOSSARY.read_text()) if name.isidentifier()}
    assert {"popularity_plan", "PackedDispatcher", "DispatchCall", "DIRECT_LOCAL"} <= identifiers
    assert sorted(identifiers & defined_names(SOURCE)) == []


def test_no_old_module_path_is_a_module_again() -> None:
    """An old path is no file of the package (this release's moves are importable through ``moeflow.moved``)."""
    paths = {name for name in old_names(GLOSSARY.read_text()) if name.startswith("moeflow.")}
    assert "moeflow.moe.pipeline" in paths
    for path in sorted(paths):
        relative = Path(*path.split(".")[1:])
        assert not (SOURCE / relative).with_suffix(".py").exists() and not (SOURCE / relative).is_dir(), path
    assert {"moeflow.moe.pipeline", "moeflow.inference.plan", "moeflow.data_parallel"} <= set(MOVED)


def test_a_slot_map_is_never_a_plan() -> None:
    offenders = []
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                offenders += [f"{path.relative_to(SOURCE)}:{node.lineno} {node.name}" for argument in arguments
                              if argument.annotation is not None and "SlotMap" in ast.unparse(argument.annotation)
                              and argument.arg != "slots"]
    assert offenders == []


def test_the_checks_see_an_old_name(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("def popularity_plan():\n    pass\n")
    assert "popularity_plan" in defined_names(tmp_path)
    assert old_names("## Renames\n\n| was | is |\n|---|---|\n| `a`, `b.c` | `d` |\n") == {"a", "b.c"}
