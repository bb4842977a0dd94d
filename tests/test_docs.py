"""The API reference (docs/api) covers the public API: every public name of a documented module has
a docstring, the pages document every top-level export, and every name autodoc cannot find by
itself (a lazily loaded export, a re-exported constant, an excluded member) is listed on a page.

Reads the pages and the sources only: it needs neither Sphinx nor a build (``make docs`` builds)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import pytest

import moeflow

API = Path(__file__).resolve().parents[1] / "docs" / "api"
REQUIRED_MODULES = (
    "moeflow.config", "moeflow.parallel", "moeflow.parallel.registry", "moeflow.parallel.schedules",
    "moeflow.parallel.context", "moeflow.perf", "moeflow.sim", "moeflow.training", "moeflow.training.launch",
    "moeflow.training.trainer", "moeflow.hf", "moeflow.inference", "moeflow.comm", "moeflow.core.capacity",
    "moeflow.core.routing", "moeflow.timing.measure",
)
DIRECTIVE = re.compile(r"^\.\. (auto\w+):: (\S+)\n((?:[ \t]+:.*\n)*)", re.MULTILINE)


@cache
def directives() -> tuple[tuple[str, str, dict[str, str]], ...]:
    """(kind, target, options) of every autodoc directive on the API pages."""
    found = []
    for page in sorted(API.rglob("*.md")):
        for kind, target, option_lines in DIRECTIVE.findall(page.read_text()):
            options = dict(re.findall(r":([\w-]+):[ \t]*(.*)", option_lines))
            found.append((kind, target, options))
    return tuple(found)


def automodules() -> dict[str, dict[str, str]]:
    return {target: options for kind, target, options in directives() if kind == "automodule"}


def listed_targets() -> set[str]:
    """The objects documented one by one (autoclass, autofunction, autodata, ...)."""
    return {target for kind, target, _ in directives() if kind != "automodule"}


def excluded(options: dict[str, str]) -> set[str]:
    return {name.strip() for name in options.get("exclude-members", "").split(",") if name.strip()}


@cache
def source_tree(module_name: str) -> ast.Module:
    return ast.parse(inspect.getsource(importlib.import_module(module_name)))


def assigned_names(module_name: str) -> list[str]:
    """Names assigned at the top level of a module's source (not under ``if TYPE_CHECKING``)."""
    names = []
    for statement in source_tree(module_name).body:
        targets = statement.targets if isinstance(statement, ast.Assign) else (
            [statement.target] if isinstance(statement, ast.AnnAssign) else [])
        names += [target.id for target in targets if isinstance(target, ast.Name)]
    return names


def has_attribute_doc(module_name: str, name: str) -> bool:
    """Whether the constant ``name`` carries documentation where it is defined (a string right after
    its assignment, or a ``#:`` comment before or beside it, as Sphinx reads them), following
    ``from ... import name`` to the module that defines it."""
    tree = source_tree(module_name)
    lines = inspect.getsource(importlib.import_module(module_name)).splitlines()
    for index, statement in enumerate(tree.body):
        if isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
            imported = [alias.name for alias in statement.names if (alias.asname or alias.name) == name]
            if imported:
                return has_attribute_doc(statement.module, imported[0])
        targets = statement.targets if isinstance(statement, ast.Assign) else (
            [statement.target] if isinstance(statement, ast.AnnAssign) else [])
        if not any(isinstance(target, ast.Name) and target.id == name for target in targets):
            continue
        following = tree.body[index + 1] if index + 1 < len(tree.body) else None
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str) and following.value.value.strip()):
            return True
        before = lines[statement.lineno - 2].strip() if statement.lineno > 1 else ""
        return before.startswith("#:") or "#:" in lines[statement.lineno - 1]
    return False


def public_names(module: ModuleType) -> list[str]:
    """A module's ``__all__``; without one, the classes and functions it defines and its
    upper-case constants (what autodoc's ``:members:`` documents when they are documented)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    defined = [name for name, value in vars(module).items()
               if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
               and value.__module__ == module.__name__]
    constants = [name for name in assigned_names(module.__name__) if name.isupper() and not name.startswith("_")
                 and not isinstance(getattr(module, name, None), TypeVar)]
    return defined + constants


def has_docstring(module: ModuleType, name: str) -> bool:
    value = getattr(module, name)
    if inspect.isclass(value):
        doc = value.__dict__.get("__doc__") or ""
        return bool(doc.strip()) and not doc.startswith(f"{value.__name__}(")  # not a dataclass's own
    if inspect.isroutine(value):
        return bool((value.__doc__ or "").strip())
    return has_attribute_doc(module.__name__, name)


def documented_modules() -> list[str]:
    return sorted({"moeflow", *automodules()})


def test_api_pages_document_every_top_level_export() -> None:
    missing = [name for name in moeflow.__all__ if f"moeflow.{name}" not in listed_targets()]
    assert not missing, f"docs/api lists no autodoc directive for moeflow.{missing}"


def test_api_pages_cover_the_public_modules() -> None:
    missing = [name for name in REQUIRED_MODULES if name not in automodules()]
    assert not missing, f"docs/api has no automodule page section for {missing}"


@pytest.mark.parametrize("module_name", documented_modules())
def test_every_public_name_has_a_docstring(module_name: str) -> None:
    module = importlib.import_module(module_name)
    undocumented = [name for name in public_names(module) if not has_docstring(module, name)]
    assert not undocumented, f"{module_name}: no docstring (or #: comment) for {undocumented}"


@pytest.mark.parametrize("module_name", sorted(automodules()))
def test_names_autodoc_cannot_find_are_listed(module_name: str) -> None:
    """``automodule :members:`` misses a lazily loaded export (not in ``dir``) and a constant a
    package re-exports (its comment is in another module), and documents nothing without
    ``:members:``; an excluded member must be documented on some other page."""
    options = automodules()[module_name]
    all_listed = "members" not in options
    module = importlib.import_module(module_name)
    skipped = excluded(options)
    unlisted = []
    for name in public_names(module):
        value = getattr(module, name)
        lazy = name not in dir(module)
        re_exported_constant = (not (inspect.isclass(value) or inspect.isroutine(value))
                                and name not in assigned_names(module_name))
        if name in skipped:
            elsewhere = any(target.endswith(f".{name}") for target in listed_targets()) or any(
                name in public_names(importlib.import_module(other)) for other in automodules() if other != module_name)
            if not elsewhere:
                unlisted.append(f"{name} (excluded, documented nowhere else)")
        elif (all_listed or lazy or re_exported_constant) and f"{module_name}.{name}" not in listed_targets():
            unlisted.append(name)
    assert not unlisted, f"docs/api: list {module_name}'s {unlisted} with autoclass/autofunction/autodata"
