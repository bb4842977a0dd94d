"""A discrete-event simulator of MoE training and inference on large clusters.

:mod:`cluster` describes the machines, :mod:`network` prices each collective on their links,
:mod:`engine` runs the operations of one step with link contention, :mod:`step` writes those
operations for a model and plan, :mod:`workload` holds the model and its routing load.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = {
    "load_cluster": "calibrated",
    **dict.fromkeys(("Cluster", "ClusterFileError", "Device", "Link", "named_clusters"), "cluster"),
    **dict.fromkeys(("Timeline", "fair_rates"), "engine"),
    **dict.fromkeys(("Network", "Transfer"), "network"),
    "StepPlan": "plan",
    **dict.fromkeys(("StepResult", "plan_label", "simulate_step", "simulated_ms"), "step"),
    **dict.fromkeys(("LayerLoad", "ModelSpec", "load_model", "model_from_toml", "named_models", "routing_loads"),
                    "workload"),
}
"""Where each public name lives: loaded on first use, so that importing one submodule (the
registry imports the regions) does not import the step, which reads the registry."""


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'moeflow.sim' has no attribute {name!r}")
    return getattr(import_module(f"moeflow.sim.{_HOMES[name]}"), name)


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
