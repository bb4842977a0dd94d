"""Sphinx configuration: MyST Markdown pages and an API reference generated from the docstrings.

Build with ``make docs`` (warnings are errors); the pages import moeflow from the repository's
virtual environment, where it is installed in editable mode.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout that is not installed

project = "moeflow"
author = "the moeflow authors"
copyright = "the moeflow authors"
release = importlib.import_module("moeflow").__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # links such as [flags](training.md#flags) resolve to a page's headings

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "all"
autoclass_content = "class"

html_theme = "alabaster"
html_title = f"moeflow {release}"
html_static_path: list[str] = []


def _defining_comment(name: str, value: Any) -> list[str] | None:
    """The ``#:`` comment (or string after the assignment) of the moeflow module that defines the
    constant ``name``: a package that re-exports a constant has no comment of its own for it."""
    from sphinx.pycode import ModuleAnalyzer

    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("moeflow") or getattr(module, name, None) is not value:
            continue
        try:
            comments = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        except Exception:  # a module without source (none in moeflow): keep looking
            continue
        if ("", name) in comments:
            return list(comments["", name])
    return None


def _comment_of_defining_module(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A constant takes the comment it has where it is defined: a package's re-exported constant
    (listed with ``autodata``) would otherwise show its type's docstring (a tuple's, an int's)."""
    if what == "data":
        comment = _defining_comment(name.rpartition(".")[2], obj)
        if comment:
            lines[:] = comment


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _comment_of_defining_module)

