"""Process groups, passed in explicitly (Megatron-Core style): one :class:`ParallelGroups` value is
built once per job from the topology and handed to every layer that communicates.

Convention for all of ``moeflow.comm``: a collective over one group takes that
``dist.ProcessGroup`` as a required argument; a topology-aware algorithm (2DH, pairwise) takes the
:class:`ParallelGroups`. Nothing in ``comm`` falls back to the default group on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.collectives import all_reduce, host_tensor
from moeflow.comm.ledger import CollectiveLedger, tracked
from moeflow.comm.streams import CommunicationStreams
from moeflow.comm.topology import NodeGroups, Topology, create_node_groups
from moeflow.comm.traffic import AllToAllTraffic

ProcessGroup = dist.ProcessGroup


def default_group() -> ProcessGroup | None:
    """The default (world) group when torch.distributed is initialized, else None (one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 for None (a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for None (a single process)."""
    return 0 if group is None else dist.get_rank(group)


def max_over_ranks(
    values: Sequence[float], group: ProcessGroup, ledger: CollectiveLedger | None = None
) -> list[float]:
    """Element-wise maximum across the group's ranks, in one all-reduce: the slowest rank's
    times, which every rank then agrees on."""
    reduced = host_tensor(values, torch.float64, group)  # a CPU tensor only where the group carries one
    with tracked(ledger, "maximum all-reduce", group, reduced.numel() * 8):
        all_reduce(reduced, group, "max")
    return reduced.tolist()


class CommunicationWorker:
    """One thread that runs collectives in issue order (the CPU counterpart of a communication
    stream): every rank then issues its collectives in the same order. Started on first use. What
    it runs are all-to-alls: each counts as queued in ``traffic`` from submission to its end."""

    def __init__(self, traffic: AllToAllTraffic | None = None) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.traffic = traffic if traffic is not None else AllToAllTraffic()

    def submit(self, function: Callable[..., Any], *args: Any) -> Future:
        """Run ``function(*args)`` on the worker thread, after everything submitted before it."""
        self.traffic.enqueue()
        future = self.executor().submit(function, *args)
        future.add_done_callback(lambda _: self.traffic.dequeue())  # also when cancelled
        return future

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-comm")
            return self._executor

    def shutdown(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


class ParallelGroups:
    """Every group an MoE layer may communicate over, and the worker that issues its collectives.

    - ``expert``: the ranks the experts are placed over (the layer's all-to-all group);
    - ``topology``: how the world's ranks sit on nodes (for 2DH and the pairwise exchange, which run
      on the world group, where ranks are numbered node-major);
    - ``model``: a tensor (model) parallel group, for schedules that need one (None today);
    - the intra-node and inter-node groups are created on the first topology-aware all-to-all (a
      collective: all ranks get there in the same order) and kept here;
    - ``ledger``: this rank's record of its collectives (:mod:`moeflow.comm.ledger`), what a hang
      reports; pass one with a progress directory for a report that names the rank behind.

    ``ParallelGroups.single_process()`` is the no-communication value.
    """

    def __init__(
        self, expert: ProcessGroup | None, topology: Topology, model: ProcessGroup | None = None,
        ledger: CollectiveLedger | None = None,
    ) -> None:
        size = group_size(expert)
        if expert is not None and expert == default_group() and topology.world_size != size:
            raise ValueError(
                f"the topology describes {topology.world_size} ranks but the world group has {size}; "
                "build it from the launcher's LOCAL_WORLD_SIZE for this job"
            )
        self.expert = expert
        self.topology = topology if expert == default_group() else Topology(size, size)
        self.model = model
        self.ledger = ledger if ledger is not None else CollectiveLedger(group_rank(default_group()),
                                                                         group_size(default_group()))
        self.traffic = AllToAllTraffic()  # the all-to-alls of every layer given these groups
        self.worker = CommunicationWorker(self.traffic)
        self.streams = CommunicationStreams()  # on CUDA: the communication stream instead of the worker
        self._node_groups: NodeGroups | None = None
        self._blocks: dict[int, ProcessGroup] = {}
        self._strided: dict[int, ProcessGroup] = {}
        self._packed: dict[int, ParallelGroups] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> ParallelGroups:
        return self  # process groups are the job's, not a model's: a copied model shares them

    @classmethod
    def single_process(cls) -> ParallelGroups:
        return cls(None, Topology(1, 1))

    @classmethod
    def from_group(
        cls, group: ProcessGroup | None, topology: Topology | None = None, ledger: CollectiveLedger | None = None
    ) -> ParallelGroups:
        """Groups for ``group`` (None: the default group, or one process when torch.distributed is
        not initialized); without a topology all ranks count as one node."""
        group = group if group is not None else default_group()
        if group is None:
            return cls.single_process()
        size = group_size(group)
        return cls(group, topology or Topology(size, size), ledger=ledger)

    @property
    def size(self) -> int:
        """Ranks in the expert group."""
        return group_size(self.expert)

    @property
    def rank(self) -> int:
        """This process's rank in the expert group."""
        return group_rank(self.expert)

    @property
    def is_world(self) -> bool:
        """Whether the expert group is the world group (where topology-aware algorithms run)."""
        return self.expert is not None and self.expert == default_group()

    def block(self, size: int) -> ProcessGroup | None:
        """This rank's block of ``size`` consecutive ranks of the expert group (ranks
        [b * size, (b + 1) * size)): Tutel's weight-gather group (§3.1.2, g = (W / E) / r ranks).
        Created on first use by the block's ranks alone (local synchronization), and kept; None
        for a block of one rank."""
        if size <= 1:
            return None
        if self.size % size:
            raise ValueError(f"blocks of {size} ranks do not tile the expert group of {self.size}")
        if size == self.size:
            return self.expert
        first = self.rank // size * size
        return self._own_subgroup(self._blocks, size, range(first, first + size))

    def packed(self, size: int) -> ParallelGroups:
        """The groups of this rank's block of ``size`` ranks (:meth:`block`), on this job's worker
        and traffic: where a packed placement's all-to-alls run (Lina's expert packing). Kept."""
        if size == self.size:
            return self
        if size not in self._packed:
            packed = ParallelGroups(self.block(size), Topology(size, size))
            packed.traffic, packed.worker, packed.streams = self.traffic, self.worker, self.streams
            packed.ledger = self.ledger
            self._packed[size] = packed
        return self._packed[size]

    def strided(self, stride: int) -> ProcessGroup | None:
        """This rank's group of the ranks of the expert group with its index modulo ``stride``
        (DeepSpeed-MoE's EP group when ESP groups are ``stride`` consecutive ranks). Created on
        first use by its ranks alone, and kept; None when it has one rank."""
        if self.size % stride:
            raise ValueError(f"a stride of {stride} ranks does not tile the expert group of {self.size}")
        if stride == self.size:
            return None
        if stride == 1:
            return self.expert
        return self._own_subgroup(self._strided, stride, range(self.rank % stride, self.size, stride))

    def _own_subgroup(self, cache: dict[int, ProcessGroup], key: int, members: range) -> ProcessGroup:
        """This rank's subgroup of the expert group's ranks ``members``, made on first use by those
        ranks alone (local synchronization: the other subgroups need not exist yet), then kept."""
        if key not in cache:
            ranks = [dist.get_global_rank(self.expert, i) for i in members]
            cache[key] = dist.new_group(ranks, use_local_synchronization=True)
        return cache[key]

    def node_groups(self) -> NodeGroups:
        if not self.is_world:
            raise ValueError("topology-aware all-to-alls run on the world group; use alltoall='linear'")
        if self._node_groups is None:
            self._node_groups = create_node_groups(self.topology)
        return self._node_groups
