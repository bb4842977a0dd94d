"""Routing: gates, top-k selection, capacity, slot assignment and router losses."""

from moeflow.core.capacity import expert_capacity
from moeflow.core.routing.gates import CosineGate, LinearGate, build_gate
from moeflow.core.routing.losses import load_balancing_loss, router_z_loss, updated_expert_bias
from moeflow.core.routing.selection import ExpertChoice, NodeLimit, node_limited, routing_scores, select_experts
from moeflow.core.routing.slots import assign_slots

__all__ = [
    "CosineGate",
    "ExpertChoice",
    "LinearGate",
    "NodeLimit",
    "assign_slots",
    "build_gate",
    "expert_capacity",
    "load_balancing_loss",
    "node_limited",
    "router_z_loss",
    "routing_scores",
    "select_experts",
    "updated_expert_bias",
]
