"""Communication: process groups and differentiable collectives."""

from moeflow.comm.algorithms import ALGORITHMS, all_to_all_with
from moeflow.comm.alltoall import all_to_all
from moeflow.comm.groups import group_rank, group_size, resolve_group

__all__ = ["ALGORITHMS", "all_to_all", "all_to_all_with", "group_rank", "group_size", "resolve_group"]
