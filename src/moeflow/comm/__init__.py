"""Communication: process groups and differentiable collectives."""

from moeflow.comm.algorithms import ALGORITHMS, all_to_all_with
from moeflow.comm.alltoall import all_to_all
from moeflow.comm.groups import ParallelGroups, default_group, group_rank, group_size

__all__ = ["ALGORITHMS", "ParallelGroups", "all_to_all", "all_to_all_with", "default_group", "group_rank", "group_size"]
