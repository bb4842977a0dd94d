"""Communication: process groups, differentiable collectives, and the ledger of each rank's collectives."""

from moeflow.comm.algorithms import ALGORITHMS, all_to_all_with
from moeflow.comm.alltoall import all_to_all
from moeflow.comm.groups import ParallelGroups, default_group, group_rank, group_size
from moeflow.comm.ledger import CollectiveError, CollectiveLedger

__all__ = [
    "ALGORITHMS", "CollectiveError", "CollectiveLedger", "ParallelGroups", "all_to_all", "all_to_all_with",
    "default_group", "group_rank", "group_size",
]
