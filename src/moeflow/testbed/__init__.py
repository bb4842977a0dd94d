"""Emulated multi-node cluster on one machine (network namespaces, veth, tc) and its launcher."""

from moeflow.testbed.cluster import ClusterError, ClusterSpec, EmulatedCluster, stale_namespaces, unavailable_reason
from moeflow.testbed.launch import launch

__all__ = ["ClusterError", "ClusterSpec", "EmulatedCluster", "launch", "stale_namespaces", "unavailable_reason"]
