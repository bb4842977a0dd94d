"""Communication: process groups and differentiable collectives."""

from moeflow.comm.alltoall import all_to_all
from moeflow.comm.groups import group_rank, group_size, resolve_group

__all__ = ["all_to_all", "group_rank", "group_size", "resolve_group"]
