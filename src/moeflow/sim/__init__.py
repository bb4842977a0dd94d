"""A discrete-event simulator of MoE training and inference on large clusters (numpy only).

:mod:`cluster` describes the machines, :mod:`network` prices each collective on their links,
:mod:`engine` runs the operations of one step with link contention, :mod:`step` writes those
operations for a model and plan, :mod:`workload` holds the model and its routing load.
"""

from moeflow.sim.calibrated import load_cluster
from moeflow.sim.cluster import Cluster, ClusterFileError, Device, Link, named_clusters
from moeflow.sim.engine import Timeline, fair_rates
from moeflow.sim.network import Network, Transfer
from moeflow.sim.step import StepPlan, StepResult, simulate_step, simulated_ms
from moeflow.sim.workload import LayerLoad, ModelSpec, load_model, model_from_toml, named_models, routing_loads

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
    "routing_loads",
    "simulate_step",
    "simulated_ms",
]
