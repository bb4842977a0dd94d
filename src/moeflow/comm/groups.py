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

import torch.distributed as dist

from moeflow.comm.collectives import reduce_values
from moeflow.comm.ledger import CollectiveLedger, tracked
from moeflow.comm.streams import CommunicationStreams
from moeflow.comm.topology import NodeGroups, Topology, create_node_groups, group_topology
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
    with tracked(ledger, "maximum all-reduce", group, len(values) * 8):
        return reduce_values(values, group, "max")  # on a CPU tensor only where the group carries one


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


NODE_LAYOUT_FIX = ("give the layer the world group, or its group with the world's topology "
                   "(ParallelGroups.from_group(group, Topology(world_size, ranks_per_node)), as moeflow train "
                   "--ep-size does)")
"""How a layer on a custom group gets the node layout that topology-aware settings need."""


def _node_layout(
    expert: ProcessGroup | None, members: tuple[int, ...], topology: Topology | None
) -> tuple[Topology, str | None]:
    """The expert group's node layout, and why it is unknown (None: known): the topology itself on
    the world group (or one process; None: one node); derived from it (:func:`group_topology`)
    when it describes the world and the group is some of its ranks; otherwise every rank on one
    node, unknown. An unknown layout refuses only the topology-aware settings, with the reason."""
    one_node = Topology(len(members), len(members))
    if expert is None or expert == default_group():
        return topology or one_node, None
    if topology is None or topology.world_size != group_size(default_group()):
        return one_node, NODE_LAYOUT_FIX
    try:
        return group_topology(members, topology), None
    except ValueError as error:
        return one_node, str(error)


class ParallelGroups:
    """Every group an MoE layer may communicate over, and the worker that issues its collectives.

    - ``expert``: the ranks the experts are placed over (the layer's all-to-all group);
    - ``topology``: how the expert group's ranks sit on nodes, numbered node-major (2DH, the
      pairwise exchange, the smart schedule and the topology-aware gate read it): the given one on
      the world group, derived from it for a group of some of the world's ranks (a DeviceMesh's
      ``"ep"`` group, given the world's topology); ``knows_nodes`` says whether it is known and
      ``node_layout_problem`` why not (a custom group without the world's topology, or one spread
      unevenly over the nodes, counts as one node);
    - ``members``: the expert group's global ranks, by group rank (what point-to-point calls address);
    - ``model``: a tensor (model) parallel group, for schedules that need one (None today);
    - the intra-node and inter-node groups are created on the first topology-aware all-to-all, each
      by its own ranks, and kept here;
    - ``ledger``: this rank's record of its collectives (:mod:`moeflow.comm.ledger`), what a hang
      reports; pass one with a progress directory for a report that names the rank behind.

    ``ParallelGroups.single_process()`` is the no-communication value.
    """

    def __init__(
        self, expert: ProcessGroup | None, topology: Topology | None, model: ProcessGroup | None = None,
        ledger: CollectiveLedger | None = None,
    ) -> None:
        size = group_size(expert)
        if expert is not None and expert == default_group() and topology is not None and topology.world_size != size:
            raise ValueError(
                f"the topology describes {topology.world_size} ranks but the world group has {size}; "
                "build it from the launcher's LOCAL_WORLD_SIZE for this job"
            )
        self.expert = expert
        self.members = tuple(dist.get_process_group_ranks(expert)) if expert is not None else (0,)
        """The expert group's global ranks, by group rank."""
        self.topology, self.node_layout_problem = _node_layout(expert, self.members, topology)
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
        not initialized). ``topology``: the world's (the world group's ranks on nodes, from which a
        sub-group's node layout is derived); without one all ranks count as one node, and a custom
        group's layout is unknown (``knows_nodes``)."""
        group = group if group is not None else default_group()
        if group is None:
            return cls.single_process()
        return cls(group, topology, ledger=ledger)

    @property
    def size(self) -> int:
        """Ranks in the expert group."""
        return group_size(self.expert)

    @property
    def rank(self) -> int:
        """This process's rank in the expert group."""
        return group_rank(self.expert)

    @property
    def knows_nodes(self) -> bool:
        """Whether the expert group's node layout is known (what topology-aware settings need)."""
        return self.node_layout_problem is None

    @property
    def is_world(self) -> bool:
        """Whether the expert group is the world group."""
        return self.expert is not None and self.expert == default_group()

    def global_rank(self, rank: int) -> int:
        """The global rank of the expert group's ``rank`` (what point-to-point calls address)."""
        return self.members[rank]

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
            packed = ParallelGroups(self.block(size), None)  # a block: one node as far as it knows
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
            ranks = [self.global_rank(i) for i in members]
            cache[key] = dist.new_group(ranks, use_local_synchronization=True)
        return cache[key]

    def node_groups(self) -> NodeGroups:
        """This rank's intra- and inter-node groups of the expert group, made on first use."""
        if not self.knows_nodes:
            raise ValueError(f"topology-aware all-to-alls need the expert group's node layout: "
                             f"{self.node_layout_problem}")
        if self._node_groups is None:
            self._node_groups = create_node_groups(self.topology, self.members, self.rank)
        return self._node_groups
