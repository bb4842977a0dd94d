"""Moved modules keep their old import paths for one release: the module itself, with a
DeprecationWarning that names where it lives now."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from moeflow.moved import MOVED, new_name


def test_every_old_path_imports_the_module_itself_with_a_warning() -> None:
    """In a fresh interpreter (one for all paths), each old path is the new path's module, under its
    own spec, after a DeprecationWarning that names the new path."""
    script = (
        "import importlib, sys, warnings\n"
        "from moeflow.moved import MOVED\n"
        "warnings.simplefilter('always')\n"
        "for old, new in sorted(MOVED.items()):\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        module = importlib.import_module(old)\n"
        "    assert module is importlib.import_module(new) and module.__spec__.name == new, (old, module.__spec__)\n"
        "    assert sys.modules[old] is module\n"
        "    print([str(w.message) for w in caught if w.category is DeprecationWarning][0].split(':')[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{old} moved to {new}" for old, new in sorted(MOVED.items())]


def test_a_submodule_of_a_moved_package_is_the_one_module() -> None:
    script = (
        "import warnings\nwarnings.simplefilter('ignore')\n"
        "from moeflow.moe.routing.router import Routing as old\n"
        "from moeflow.core.routing.router import Routing as new\n"
        "from moeflow.sim.cluster import Cluster as old_cluster\n"
        "from moeflow.perf.sim.cluster import Cluster as new_cluster\n"
        "print(old is new and old_cluster is new_cluster)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr


def test_only_moved_names_are_answered() -> None:
    assert new_name("moeflow.moe.routing.router") == "moeflow.core.routing.router"
    assert new_name("moeflow.moe.layer") is None
    assert new_name("moeflow.sim.step") is None  # the simulator's step stayed in moeflow.sim
    assert new_name("moeflow.moe.routingx") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("moeflow.moe.no_such_module")


def test_every_new_path_exists() -> None:
    for new in MOVED.values():
        assert importlib.util.find_spec(new) is not None, new
