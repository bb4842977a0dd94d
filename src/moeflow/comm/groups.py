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
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from moeflow.comm.collectives import all_gather_objects, host_device, reduce_values
from moeflow.comm.ledger import CollectiveLedger, tracked
from moeflow.comm.streams import CommunicationStreams
from moeflow.comm.topology import NodeGroups, Topology, group_topology
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
    - its subgroups, made up front by every rank of the world in one order (NCCL splits a
      communicator only when every rank takes part): the blocks of consecutive ranks and the
      strided groups of every size that divides the expert group (Tutel's weight-gather groups,
      DeepSpeed-MoE's EP groups, Lina's packed blocks and their copies), of which the intra-node
      and inter-node groups of the node layout are two; on a subgroup of the world, every expert
      group's (one all-gather of the members over the world, so every rank builds its groups together);
    - ``ledger``: this rank's record of its collectives (:mod:`moeflow.comm.ledger`), what a hang
      reports; pass one with a progress directory for a report that names the rank behind.

    ``ParallelGroups.single_process()`` is the no-communication value.
    """

    def __init__(
        self, expert: ProcessGroup | None, topology: Topology | None, model: ProcessGroup | None = None,
        ledger: CollectiveLedger | None = None, subgroups: dict[tuple[str, int], ProcessGroup | None] | None = None,
    ) -> None:
        size = group_size(expert)
        if expert is not None and expert == default_group() and topology is not None and topology.world_size != size:
            raise ValueError(
                f"the topology describes {topology.world_size} ranks but the world group has {size}; "
                "build it from the launcher's LOCAL_WORLD_SIZE for this job"
            )
        self.expert = expert
        self._world_topology = topology
        self.members = tuple(dist.get_process_group_ranks(expert)) if expert is not None else (0,)
        """The expert group's global ranks, by group rank."""
        self.topology, self.node_layout_problem = _node_layout(expert, self.members, topology)
        self.model = model
        self.ledger = ledger if ledger is not None else CollectiveLedger(group_rank(default_group()),
                                                                         group_size(default_group()))
        self.traffic = AllToAllTraffic()  # the all-to-alls of every layer given these groups
        self.worker = CommunicationWorker(self.traffic)
        self.streams = CommunicationStreams()  # on CUDA: the communication stream instead of the worker
        self._subgroups = subgroups if subgroups is not None else make_subgroups(expert, self.members)
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
        Made with the groups; None for a block of one rank."""
        if size <= 1:
            return None
        if self.size % size:
            raise ValueError(f"blocks of {size} ranks do not tile the expert group of {self.size}")
        return self.expert if size == self.size else self._subgroup("block", size)

    def packed(self, size: int) -> ParallelGroups:
        """The groups of this rank's block of ``size`` ranks (:meth:`block`), on this job's worker
        and traffic: where a packed placement's all-to-alls run (Lina's expert packing). Kept."""
        if size == self.size:
            return self
        if size not in self._packed:  # a block: one node as far as it knows, and no subgroups of its own
            packed = ParallelGroups(self.block(size), None, subgroups={})
            packed.traffic, packed.worker, packed.streams = self.traffic, self.worker, self.streams
            packed.ledger = self.ledger
            self._packed[size] = packed
        return self._packed[size]

    def over(self, expert: ProcessGroup) -> ParallelGroups:
        """These groups over ``expert``, another group of the same ranks, with subgroups of its own
        (made here, by every rank of the world) and this ledger: a second lane, whose collectives
        never pair with this one's when two threads issue them (a pipeline's overlapped forward and
        backward)."""
        members = tuple(dist.get_process_group_ranks(expert))
        if members != self.members:
            raise ValueError(f"a second lane of the expert group {self.members} needs a group of the same ranks, "
                             f"got {members}")
        return ParallelGroups(expert, self._world_topology, self.model, self.ledger)

    def strided(self, stride: int) -> ProcessGroup | None:
        """This rank's group of the ranks of the expert group with its index modulo ``stride``
        (DeepSpeed-MoE's EP group when ESP groups are ``stride`` consecutive ranks). Made with the
        groups; None when it has one rank."""
        if self.size % stride:
            raise ValueError(f"a stride of {stride} ranks does not tile the expert group of {self.size}")
        if stride == self.size:
            return None
        return self.expert if stride == 1 else self._subgroup("strided", stride)

    def _subgroup(self, kind: str, size: int) -> ProcessGroup | None:
        if (kind, size) not in self._subgroups:
            raise ValueError(f"this ParallelGroups made no {kind} subgroups of {size} (a packed block's groups have "
                             "none of their own): give the layer the job's ParallelGroups")
        return self._subgroups[(kind, size)]

    def node_groups(self) -> NodeGroups:
        """This rank's intra-node group (the block of its node's ranks) and inter-node group (the
        ranks of its local index on every node: a stride of the ranks per node); None for a hop of
        this rank alone (one node, or one rank per node)."""
        if not self.knows_nodes:
            raise ValueError(f"topology-aware all-to-alls need the expert group's node layout: "
                             f"{self.node_layout_problem}")
        per_node = self.topology.ranks_per_node
        return NodeGroups(self.block(per_node), self.strided(per_node))


def proper_divisors(size: int) -> list[int]:
    """The sizes of the subgroups a group of ``size`` ranks may need: 1 < d < size, d divides it."""
    return [divisor for divisor in range(2, size) if size % divisor == 0]


def subgroup_ranks(members: Sequence[int]) -> dict[tuple[str, int], list[list[int]]]:
    """An expert group's subgroups by (kind, size), as global ranks: ``("block", d)``, the blocks of
    d consecutive group ranks; ``("strided", s)``, the groups of the ranks s apart."""
    ranks = list(members)
    layout: dict[tuple[str, int], list[list[int]]] = {}
    for divisor in proper_divisors(len(ranks)):
        layout[("block", divisor)] = [ranks[first:first + divisor] for first in range(0, len(ranks), divisor)]
        layout[("strided", divisor)] = [ranks[first::divisor] for first in range(divisor)]
    return layout


def make_subgroups(expert: ProcessGroup | None, members: tuple[int, ...]) -> dict[tuple[str, int], ProcessGroup | None]:
    """This rank's subgroups of its expert group (:func:`subgroup_ranks`), made by every rank of the
    world in one order: every expert group's (learned by one all-gather over the world when the
    expert group is not the world), each group once, on the expert group's backend. Nothing for
    one process."""
    if expert is None:
        return {}
    world = group_size(default_group())
    layouts = [members] if len(members) == world else sorted(set(all_gather_objects(members)))
    backend = str(dist.get_backend(expert))  # host values then travel on the same device as on the expert group
    timeout = group_timeout(expert)  # a hang on a subgroup fails as soon as one on the expert group would
    made: dict[tuple[int, ...], ProcessGroup] = {}
    mine: dict[tuple[str, int], ProcessGroup | None] = {}
    for layout in layouts:
        for key, groups in subgroup_ranks(layout).items():
            for ranks in groups:
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks, backend=backend, timeout=timeout)
                if layout == members and members[group_rank(expert)] in ranks:
                    mine[key] = made[tuple(ranks)]
    return mine


def group_timeout(group: ProcessGroup) -> timedelta | None:
    """The collective timeout ``group`` was made with (torch keeps it on the group's backend, in a
    private field: None, torch's default, where this torch does not have it)."""
    try:
        timeout = group._get_backend(host_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None
