"""A discrete-event simulator of MoE training and inference on large clusters.

This package sits above the techniques and reads their records: :mod:`~moeflow.sim.step` writes
one step's operations for a model and plan, :mod:`~moeflow.sim.planner` searches the plans,
:mod:`~moeflow.sim.layer_ranking` ranks a layer's candidates for its online planner. The machinery
lies below the techniques, in :mod:`moeflow.perf.sim`: :mod:`~moeflow.perf.sim.cluster` describes
the machines, :mod:`~moeflow.perf.sim.network` prices each collective on their links,
:mod:`~moeflow.perf.sim.engine` runs the operations with link contention,
:mod:`~moeflow.perf.sim.workload` holds the model and its routing load.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = {
    "load_cluster": "moeflow.sim.calibrated",
    **dict.fromkeys(("Cluster", "ClusterFileError", "Device", "Link", "named_clusters"), "moeflow.perf.sim.cluster"),
    **dict.fromkeys(("Timeline", "fair_rates"), "moeflow.perf.sim.engine"),
    **dict.fromkeys(("Network", "Transfer"), "moeflow.perf.sim.network"),
    "StepPlan": "moeflow.perf.sim.plan",
    **dict.fromkeys(("StepResult", "plan_label", "simulate_step", "simulated_ms"), "moeflow.sim.step"),
    **dict.fromkeys(("LayerLoad", "ModelSpec", "load_model", "model_from_toml", "named_models", "routing_loads"),
                    "moeflow.perf.sim.workload"),
}
"""Where each public name lives: loaded on first use, so that ``from moeflow.sim import StepPlan``
loads the machinery alone, not the step and the registry."""


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'moeflow.sim' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)


__all__ = [
    "Cluster",
    "ClusterFileError",
    "Device",
    "LayerLoad",
    "Link",
    "ModelSpec",
    "Network",
    "StepPlan",
    "StepResult",
    "Timeline",
    "Transfer",
    "fair_rates",
    "load_cluster",
    "load_model",
    "model_from_toml",
    "named_clusters",
    "named_models",
    "plan_label",
    "routing_loads",
    "simulate_step",
    "simulated_ms",
]
