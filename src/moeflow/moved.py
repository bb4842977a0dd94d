"""Import paths that moved, kept working for one release with a DeprecationWarning naming the new one.

The folders follow the layers (``docs/design/architecture.md``), so a module that changed layer
changed folder. Old code keeps importing it by its old name here: :class:`MovedModules`, installed
first on ``sys.meta_path`` when ``moeflow`` is imported, answers only for the names in
:data:`MOVED` (and their submodules) and hands back the module itself under its new name, so an
old and a new import see one module, one class, one ``isinstance``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED: dict[str, str] = {
    "moeflow.data_parallel": "moeflow.training.data_parallel",
    "moeflow.moe.capacity": "moeflow.core.capacity",
    "moeflow.moe.stats": "moeflow.core.stats",
    "moeflow.moe.experts": "moeflow.core.experts",
    "moeflow.moe.routing": "moeflow.core.routing",
    "moeflow.moe.dispatchers.slot_map": "moeflow.core.slot_map",
    "moeflow.moe.dispatchers": "moeflow.parallel.dispatchers",
    "moeflow.kernels.workspace": "moeflow.core.workspace",
    "moeflow.kernels.device_copy": "moeflow.core.device_copy",
    "moeflow.moe.dispatchers.encoding": "moeflow.kernels.slot_gather",
    "moeflow.moe.planning": "moeflow.parallel.online_planner",
    "moeflow.moe.online_planner": "moeflow.parallel.online_planner",
    "moeflow.moe.agreement": "moeflow.parallel.agreement",
    "moeflow.moe.pipeline": "moeflow.parallel.chunk_pipeline",
    "moeflow.parallel.forward_memory": "moeflow.moe.forward_memory",
    **{f"moeflow.sim.{name}": f"moeflow.perf.sim.{name}" for name in (
        "builder", "cluster", "cores", "engine", "network", "parm_regions", "plan", "regions", "technique",
        "workload")},
    "moeflow.inference.plan": "moeflow.inference.assignment",
    "moeflow.hf.training": "moeflow.training.hf_model",
    "moeflow.hf.export": "moeflow.training.hf_export",
}
"""Old module (or package) -> where it lives now; a submodule of a moved package moved with it."""


def new_name(name: str) -> str | None:
    """Where the module ``name`` lives now, or None if it did not move (the longest moved prefix
    wins). Asked for every import in the process, so one dictionary lookup per dotted prefix."""
    if not name.startswith("moeflow."):
        return None
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        old = ".".join(parts[:end])
        if old in MOVED:
            return MOVED[old] + name[len(old):]
    return None


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module under its old name and loads it as the module of its new name."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return None if new_name(fullname) is None else importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None
        warnings.warn(f"{spec.name} moved to {new}: import it from there ({spec.name} goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # import machinery sets __spec__ to the old name's: restored below
        return module

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is not None and spec.loader_state is not None:
            module.__spec__ = spec.loader_state


def install() -> None:
    """Put the finder first on ``sys.meta_path`` once: before the path finder, which would otherwise
    load a moved package's submodule a second time under its old name."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
