"""moeflow: fast distributed Mixture-of-Experts training and inference on torch.distributed.

``import moeflow`` stays light: the layer (and torch) load on first use of ``moeflow.MoELayer``, so
the numpy-only parts (``moeflow.perf``, the planner) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeflow.config import MoEConfig
    from moeflow.core.stats import RoutingStats
    from moeflow.moe.layer import MoELayer

__all__ = ["MoEConfig", "MoELayer", "RoutingStats"]

from moeflow.moved import install as _install_moved_paths

_install_moved_paths()  # old import paths of moved modules keep working, with a DeprecationWarning
__version__ = "0.1.0"

_HOMES = {"MoEConfig": "moeflow.config", "MoELayer": "moeflow.moe.layer", "RoutingStats": "moeflow.core.stats"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'moeflow' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
