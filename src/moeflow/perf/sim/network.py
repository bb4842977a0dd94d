"""What each collective asks of the network: per-resource busy time and latency.

Resources are every GPU's intra-node link out and in, and every node's NICs out and in (a
non-blocking core between nodes). A :class:`Transfer` is one step of a collective: the seconds each
resource would be busy if the transfer ran alone (bytes over bandwidth, plus each message's gap)
and the latency it pays once. The engine shares a resource between concurrent transfers; this
module only counts bytes and messages. Byte matrices are (W, W): ``matrix[s, d]`` bytes from rank s
to rank d, ranks node-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moeflow.perf.sim.cluster import Cluster

ALLREDUCE_ALGORITHMS = ("ring", "tree")
TREE_CHUNK_BYTES = 512 * 1024  # NCCL's tree pipelines the buffer in chunks of about this size


@dataclass(frozen=True)
class Transfer:
    """One step of a collective. ``work[r]``: seconds resource r is busy when alone."""

    work: np.ndarray
    latency_s: float
    name: str = ""

    @property
    def alone_s(self) -> float:
        return self.latency_s + float(self.work.max(initial=0.0))


@dataclass(frozen=True)
class LocalCopy:
    """A memory-bound copy on every rank between two steps (2DH's stride copies)."""

    bytes_per_rank: float


Step = Transfer | LocalCopy


def _scaled(step: Step, scale: float, latency_s: float = 0.0) -> Step:
    """A transfer whose link time is ``scale`` times the ideal (the cluster's ``collective_scale``),
    ``latency_s`` later (its ``collective_latency``)."""
    if (scale == 1.0 and not latency_s) or not isinstance(step, Transfer):
        return step
    return Transfer(step.work * scale, step.latency_s + latency_s, step.name)


class Network:
    """Transfers of the collectives moeflow runs, on one cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.world = cluster.world_size
        self.per_node = cluster.gpus_per_node
        self.nodes = cluster.nodes
        self.resources = 2 * self.world + 2 * self.nodes

    # -- resource vectors ------------------------------------------------------------------------

    def _work(self, gpu_out: np.ndarray | float = 0.0, gpu_in: np.ndarray | float = 0.0,
              nic_out: np.ndarray | float = 0.0, nic_in: np.ndarray | float = 0.0) -> np.ndarray:
        w, n = self.world, self.nodes
        work = np.empty(self.resources)
        work[:w], work[w:2 * w], work[2 * w:2 * w + n], work[2 * w + n:] = gpu_out, gpu_in, nic_out, nic_in
        return work

    def _intra(self, messages: float, nbytes: float) -> float:
        link = self.cluster.intra
        return messages * link.message_overhead_s + nbytes / link.bandwidth

    def _inter(self, messages: float, nbytes: float, peers: float = 1.0) -> float:
        """A node's NIC time for ``messages`` messages of ``nbytes`` in all, each from a rank that
        exchanges with ``peers`` ranks across nodes in this collective."""
        return messages * self.cluster.node_message_overhead_s(peers) + nbytes / self.cluster.node_bandwidth

    def _latency(self, intra: bool, inter: bool) -> float:
        return max(self.cluster.intra.latency_s if intra else 0.0, self.cluster.nic.latency_s if inter else 0.0)

    # -- all-to-all ------------------------------------------------------------------------------

    def alltoall(self, algorithm: str, pair_bytes: float | np.ndarray, inter_share: float = 1.0) -> list[Step]:
        """An all-to-all where every rank sends ``pair_bytes`` to every other (uniform), or the byte
        matrix of a skewed one; 2DH's phase between nodes moves ``inter_share`` of its bytes (a token
        sent once to each node)."""
        if self.world == 1:
            return []
        return self.scaled(algorithm, self._alltoall_steps(algorithm, pair_bytes, inter_share))

    def scaled(self, algorithm: str, steps: list[Step]) -> list[Step]:
        """``steps`` of ``algorithm`` at the implementation's rate (the cluster's ``collective_scale``),
        the call's own start-up (its ``collective_latency``) on its first transfer."""
        scale = self.cluster.collective_scale.get(algorithm, 1.0)
        extra = self.cluster.collective_latency.get(algorithm, 0.0)
        first = next((i for i, step in enumerate(steps) if isinstance(step, Transfer)), None)
        return [_scaled(step, scale, extra if i == first else 0.0) for i, step in enumerate(steps)]

    def _alltoall_steps(self, algorithm: str, pair_bytes: float | np.ndarray, inter_share: float = 1.0) -> list[Step]:
        matrix = None if np.isscalar(pair_bytes) else np.asarray(pair_bytes, dtype=np.float64)
        if algorithm == "linear" or (algorithm == "2dh" and (self.nodes == 1 or self.per_node == 1)):
            return [self._linear(pair_bytes, matrix)]
        if algorithm == "2dh":
            return self._two_dimensional(pair_bytes, matrix, inter_share)
        if algorithm == "pairwise":
            return self.pairwise_steps(pair_bytes)
        raise ValueError(f"unknown all-to-all algorithm {algorithm!r}; use linear, 2dh or pairwise")

    def _linear(self, pair_bytes: float | np.ndarray, matrix: np.ndarray | None) -> Transfer:
        g, w = self.per_node, self.world
        if matrix is None:
            b = float(pair_bytes)
            gpu = self._intra(g - 1, (g - 1) * b)
            nic = self._inter(g * (w - g), g * (w - g) * b, w - g)
            return Transfer(self._work(gpu, gpu, nic, nic), self._latency(g > 1, self.nodes > 1), "alltoall.linear")
        blocks, same_node = self._blocks(matrix)
        intra = np.where(same_node, matrix, 0.0)
        np.fill_diagonal(intra, 0.0)
        inter_out, inter_in = self._node_traffic(blocks)
        inter_msgs_out, inter_msgs_in = self._node_traffic(self._blocks(matrix > 0)[0])
        work = self._work(
            self._intra((intra > 0).sum(1), intra.sum(1)), self._intra((intra > 0).sum(0), intra.sum(0)),
            self._inter(inter_msgs_out, inter_out, w - g), self._inter(inter_msgs_in, inter_in, w - g),
        )
        return Transfer(work, self._latency(g > 1, self.nodes > 1), "alltoall.linear")

    def _two_dimensional(self, pair_bytes: float | np.ndarray, matrix: np.ndarray | None,
                         inter_share: float = 1.0) -> list[Step]:
        """Tutel's 2DH: stride copy, all-to-all inside each node (to the local rank that owns the
        destination's local index), stride copy, all-to-all among same-local-rank ranks."""
        g, n = self.per_node, self.nodes
        if matrix is None:
            b = float(pair_bytes)
            gpu = self._intra(g - 1, (g - 1) * n * b)
            nic = self._inter(g * (n - 1), g * (n - 1) * g * b * inter_share, n - 1)
            total = self.world * b
            phase1 = Transfer(self._work(gpu, gpu, 0.0, 0.0), self.cluster.intra.latency_s, "alltoall.2dh.intra")
            phase2 = Transfer(self._work(0.0, 0.0, nic, nic), self.cluster.nic.latency_s, "alltoall.2dh.inter")
            return [LocalCopy(total), phase1, LocalCopy(total), phase2]
        grid = matrix.reshape(n, g, n, g)  # [source node, source local, destination node, destination local]
        first = grid.sum(axis=2)  # rank (n, a) sends to (n, c) everything bound for local index c
        np.einsum("naa->na", first)[...] = 0.0
        second = grid.sum(axis=1)  # rank (n, c) sends to (m, c) what its node's ranks gave it
        off_node = second * (1 - np.eye(n))[:, :, None] * inter_share
        out_bytes, in_bytes = off_node.sum(axis=(1, 2)), off_node.sum(axis=(0, 2))
        out_msgs = (off_node > 0).sum(axis=(1, 2))
        in_msgs = (off_node > 0).sum(axis=(0, 2))
        phase1 = Transfer(self._work(self._intra((first > 0).sum(2).ravel(), first.sum(2).ravel()),
                                     self._intra((first > 0).sum(1).ravel(), first.sum(1).ravel()), 0.0, 0.0),
                          self.cluster.intra.latency_s, "alltoall.2dh.intra")
        phase2 = Transfer(self._work(0.0, 0.0, self._inter(out_msgs, out_bytes, n - 1),
                                     self._inter(in_msgs, in_bytes, n - 1)),
                          self.cluster.nic.latency_s, "alltoall.2dh.inter")
        copy = float(matrix.sum(1).max())
        return [LocalCopy(copy), phase1, LocalCopy(copy), phase2]

    def strided_alltoall(self, pair_bytes: float, stride: int) -> list[Step]:
        """Linear all-to-all inside each group of ranks equal modulo ``stride`` (DeepSpeed-MoE's EP
        group when its ESP groups are ``stride`` consecutive ranks): ``pair_bytes`` to each member."""
        ranks = np.arange(self.world)
        matrix = np.where(ranks[:, None] % stride == ranks[None, :] % stride, float(pair_bytes), 0.0)
        np.fill_diagonal(matrix, 0.0)
        return self.alltoall("linear", matrix) if matrix.any() else []

    def pairwise_steps(self, pair_bytes: float | np.ndarray) -> list[Step]:
        """FasterMoE's grouped pairwise exchange: step 0 inside each node, then one step per other
        node (node i sends to node i - j). A skewed matrix is priced per step by its busiest node."""
        g, n = self.per_node, self.nodes
        matrix = None if np.isscalar(pair_bytes) else np.asarray(pair_bytes, dtype=np.float64)
        steps: list[Step] = []
        if matrix is None:  # the n - 1 equal inter-node steps on the same links: one transfer of their sum
            inter = [self.pairwise_inter_step(float(pair_bytes), n - 1)] if n > 1 else []
            return [self.pairwise_intra_step(float(pair_bytes))] * (g > 1) + inter
        if g > 1:
            steps.append(self._linear(0.0, np.where(self._blocks(matrix)[1], matrix, 0.0)))
        for shift in range(1, n):
            partner = (np.arange(n) - shift) % n
            blocks = self._blocks(matrix)[0]
            sent = blocks[np.arange(n), partner]
            counts = self._blocks(matrix > 0)[0][np.arange(n), partner]
            received = np.zeros(n)
            received[partner] = sent
            received_msgs = np.zeros(n)
            received_msgs[partner] = counts
            work = self._work(0.0, 0.0, self._inter(counts, sent, g), self._inter(received_msgs, received, g))
            steps.append(Transfer(work, self.cluster.nic.latency_s, "pairwise.inter"))
        return steps

    def pairwise_intra_step(self, pair_bytes: float) -> Transfer:
        """Step 0 of the pairwise exchange: the node's own ranks, over the intra-node links."""
        gpu = self._intra(self.per_node - 1, (self.per_node - 1) * pair_bytes)
        return Transfer(self._work(gpu, gpu), self.cluster.intra.latency_s, "pairwise.intra")

    def pairwise_inter_step(self, pair_bytes: float, steps: int = 1) -> Transfer:
        """``steps`` uniform inter-node steps: every rank of a node to every rank of one other."""
        g = self.per_node
        nic = steps * self._inter(g * g, g * g * pair_bytes, g)
        return Transfer(self._work(0.0, 0.0, nic, nic), steps * self.cluster.nic.latency_s, "pairwise.inter")

    def broadcast(self, nbytes: float) -> list[Step]:
        """``nbytes`` from one rank to all, pipelined down a chain (NCCL's ring broadcast): every
        link carries the buffer once."""
        if self.world == 1 or nbytes <= 0:
            return []
        gpu = self._intra(1, nbytes) if self.per_node > 1 else 0.0
        nic = self._inter(1, nbytes) if self.nodes > 1 else 0.0
        latency = self.nodes * self.cluster.nic.latency_s + self.per_node * self.cluster.intra.latency_s
        return [Transfer(self._work(gpu, gpu, nic, nic), latency, "broadcast.ring")]

    def _blocks(self, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Node-to-node sums of a (W, W) matrix, and the same-node mask of its entries."""
        n, g = self.nodes, self.per_node
        blocks = matrix.reshape(n, g, n, g).sum(axis=(1, 3)).astype(np.float64)
        node = np.arange(self.world) // g
        return blocks, node[:, None] == node[None, :]

    def _node_traffic(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        off = blocks * (1 - np.eye(self.nodes))
        return off.sum(1), off.sum(0)

    # -- reductions and gathers ------------------------------------------------------------------

    def allreduce(self, nbytes: float, algorithm: str = "auto", group: int | None = None) -> list[Step]:
        """All-reduce of ``nbytes`` per rank over the world: NCCL's ring (2 (W - 1) steps of
        nbytes / W) or double binary tree (log-depth, each node sending about 2 nbytes); ``auto``
        takes the faster alone, as NCCL's tuner does. Over groups of ``group`` consecutive ranks
        (tensor or expert-sharding parallelism): a ring reduce-scatter then all-gather."""
        if group is not None and group < self.world:
            return self.reducescatter(nbytes, group) + self.allgather(nbytes / group, group)
        if self.world == 1 or nbytes <= 0:
            return []
        if algorithm == "auto":
            best = min((self._ring_allreduce(nbytes), self._tree_allreduce(nbytes)), key=lambda t: t.alone_s)
            return self.scaled("allreduce", [best])
        if algorithm == "ring":
            return self.scaled("allreduce", [self._ring_allreduce(nbytes)])
        if algorithm == "tree":
            return self.scaled("allreduce", [self._tree_allreduce(nbytes)])
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; use ring, tree or auto")

    def strided_allreduce(self, nbytes: float, stride: int) -> list[Step]:
        """Ring all-reduce of ``nbytes`` per rank inside each group of ranks equal modulo ``stride``
        (the data-parallel copies of an expert group's experts), every group at once: a node carries
        one hop out per ring with members in it, each step."""
        size = self.world // stride
        if size <= 1 or nbytes <= 0:
            return []
        steps, chunk = 2 * (size - 1), nbytes / size
        members_per_node = max(1, self.per_node // stride)
        spans_nodes = size > members_per_node
        rings = min(stride, self.per_node)  # groups with members in each node
        gpu = self._intra(steps, steps * chunk) if members_per_node > 1 else 0.0
        nic = self._inter(steps * max(rings, self.cluster.nics_per_node), steps * chunk * rings) if spans_nodes else 0.0
        latency = steps * self._latency(members_per_node > 1, spans_nodes)
        return self.scaled("allreduce", [Transfer(self._work(gpu, gpu, nic, nic), latency, "allreduce.strided")])

    def onto(self, group: Network, steps: list[Step]) -> list[Step]:
        """``steps`` of this (the world's) network as the first expert group's resources see them:
        its ranks' links and its nodes' NICs (a group inside a node sees its node's NIC)."""
        w, n, ranks, nodes = self.world, self.nodes, group.world, group.nodes
        keep = np.concatenate([np.arange(ranks), w + np.arange(ranks), 2 * w + np.arange(nodes),
                               2 * w + n + np.arange(nodes)])
        return [Transfer(step.work[keep], step.latency_s, step.name) if isinstance(step, Transfer) else step
                for step in steps]

    def _ring_allreduce(self, nbytes: float) -> Transfer:
        w, g = self.world, self.per_node
        steps = 2 * (w - 1)
        chunk = nbytes / w
        gpu = self._intra(steps, steps * chunk) if g > 1 else 0.0
        nic = self._inter(steps * self.cluster.nics_per_node, steps * chunk) if self.nodes > 1 else 0.0
        return Transfer(self._work(gpu, gpu, nic, nic), steps * self._latency(g > 1, self.nodes > 1), "allreduce.ring")

    def _tree_allreduce(self, nbytes: float) -> Transfer:
        g, n = self.per_node, self.nodes
        chunks = max(1, math.ceil(nbytes / TREE_CHUNK_BYTES))
        gpu = self._intra(2 * chunks, 2 * nbytes) if g > 1 else 0.0
        nic = self._inter(2 * chunks, 2 * nbytes) if n > 1 else 0.0
        depth = 2 * math.ceil(math.log2(n)) if n > 1 else 0
        latency = depth * self.cluster.nic.latency_s + 2 * (g - 1) * self.cluster.intra.latency_s
        return Transfer(self._work(gpu, gpu, nic, nic), latency, "allreduce.tree")

    def allgather(self, nbytes: float, group: int | None = None) -> list[Step]:
        """Ring all-gather of ``nbytes`` per rank over groups of ``group`` consecutive ranks (the
        world by default; a group inside one node uses only intra-node links)."""
        return self._ring_pass(nbytes, group, "allgather")

    def reducescatter(self, nbytes: float, group: int | None = None) -> list[Step]:
        """Ring reduce-scatter of ``nbytes`` per rank (its whole input) over ``group`` ranks."""
        size = self.world if group is None else group
        return self._ring_pass(nbytes / max(size, 1), group, "reducescatter")

    def _ring_pass(self, chunk: float, group: int | None, name: str) -> list[Step]:
        size = self.world if group is None else group
        if size <= 1 or chunk <= 0:
            return []
        if self.world % size or (size < self.world and self.per_node % size and size % self.per_node):
            raise ValueError(f"a group of {size} ranks must divide the {self.world} ranks and tile the nodes")
        steps = size - 1
        spans_nodes = size > self.per_node
        within = min(size, self.per_node)
        gpu = self._intra(steps, steps * chunk) if within > 1 else 0.0
        nic = self._inter(steps * self.cluster.nics_per_node, steps * chunk) if spans_nodes else 0.0
        latency = steps * self._latency(within > 1, spans_nodes)
        return self.scaled(name, [Transfer(self._work(gpu, gpu, nic, nic), latency, f"{name}.ring")])
