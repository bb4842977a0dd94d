"""moeflow: fast distributed Mixture-of-Experts training and inference on torch.distributed."""

from moeflow.config import MoEConfig
from moeflow.layer import MoELayer
from moeflow.stats import RoutingStats

__all__ = ["MoEConfig", "MoELayer", "RoutingStats"]
__version__ = "0.1.0"
