"""Performance models: alpha-beta fits, cluster profiles, cost functions, FasterMoE's busiest-link
model (Eq. 2) and its shadowing decision.

Plain math on numbers: nothing here imports torch.distributed, so planners and simulators can use it.
"""

from moeflow.perf.alphabeta import AlphaBeta, fit_alpha_beta, median_relative_error
from moeflow.perf.busiest_link import communication_latency, link_loads
from moeflow.perf.cost import CostModel
from moeflow.perf.profile import PROFILE_VERSION, ClusterProfile, ProfileDevice
from moeflow.perf.shadowing import LinkPrices, ShadowDecision, ShadowPrices, select_shadowed_experts, shadowed_latency

__all__ = [
    "PROFILE_VERSION",
    "AlphaBeta",
    "ClusterProfile",
    "CostModel",
    "LinkPrices",
    "ProfileDevice",
    "ShadowDecision",
    "ShadowPrices",
    "communication_latency",
    "fit_alpha_beta",
    "link_loads",
    "median_relative_error",
    "select_shadowed_experts",
    "shadowed_latency",
]
