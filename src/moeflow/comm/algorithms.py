"""All-to-all algorithms with one contract: input laid out by destination rank, output by source
rank, equal splits (None) or explicit ``input_splits``/``output_splits`` in rows.

- ``linear``: ``dist.all_to_all_single``, one step.
- ``2dh``: Tutel's two-dimensional hierarchical all-to-all (Algorithm 2): stride copy, all-to-all
  among the ranks of a node, stride copy, all-to-all among the same-local-rank ranks of all nodes.
  Every rank sends N + G messages instead of W, which wins when per-message latency dominates.
- ``pairwise``: FasterMoE's grouped pairwise exchange (4.2): ranks form groups (one per node) on a
  ring; in step j group i sends to group (i - j) and receives from group (i + j). Each step is
  usable alone (:func:`pairwise_step`) for a fine-grained send/compute/receive schedule.

All are differentiable: the backward of an all-to-all is the same algorithm with the split matrix
transposed. They run on any expert group whose node layout is known (``groups.knows_nodes``: the
world group, or a mesh's group given the world's topology); ranks are the group's, numbered
node-major, and point-to-point calls address their global ranks (``groups.members``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.alltoall import all_to_all, linear_all_to_all
from moeflow.comm.collectives import all_gather, send_and_receive
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.comm.wire import from_wire, to_wire
from moeflow.config import ALLTOALL_ALGORITHMS, EXACT_WIRE

ALGORITHMS = ALLTOALL_ALGORITHMS
"""The all-to-all algorithms: ``linear``, ``2dh`` (Tutel's two-dimensional hierarchical) and ``pairwise``."""
SplitMatrix = list[list[int]]  # rows[s][d]: rows rank s sends to rank d


def split_matrix(
    x: torch.Tensor, world_size: int, input_splits: Sequence[int] | None, group: dist.ProcessGroup | None = None
) -> SplitMatrix:
    """Every rank's input splits (one all-gather); equal splits need no communication."""
    if input_splits is None:
        if x.shape[0] % world_size:
            raise ValueError(f"{x.shape[0]} rows cannot be split equally over {world_size} ranks")
        chunk = x.shape[0] // world_size
        return [[chunk] * world_size for _ in range(world_size)]
    if len(input_splits) != world_size or sum(input_splits) != x.shape[0]:
        raise ValueError(
            f"input_splits {list(input_splits)} must have {world_size} entries summing to {x.shape[0]} rows"
        )
    local = torch.tensor(list(input_splits), dtype=torch.int64, device=x.device)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    all_gather(parts, local, group)
    return torch.stack(parts).cpu().tolist()


def distinct_algorithms(topology: Topology) -> tuple[str, ...]:
    """The algorithms that differ from linear on this topology: 2DH needs several nodes of several
    ranks, pairwise several nodes (on one node both reduce to a single exchange)."""
    nodes, per_node = topology.num_nodes, topology.ranks_per_node
    distinct = {"linear": True, "2dh": nodes > 1 and per_node > 1, "pairwise": nodes > 1}
    return tuple(a for a in ALGORITHMS if distinct[a])


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown alltoall algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def transpose(matrix: SplitMatrix) -> SplitMatrix:
    """The split matrix of an exchange's adjoint: what rank d sent rank s comes back."""
    return [list(column) for column in zip(*matrix, strict=True)]


# -- 2DH --------------------------------------------------------------------------------------


def _alltoall_2dh(x: torch.Tensor, parallel_groups: ParallelGroups, matrix: SplitMatrix) -> torch.Tensor:
    groups, topology = parallel_groups.node_groups(), parallel_groups.topology
    me = parallel_groups.rank
    if groups.intra_node is None or groups.inter_node is None:  # one hop of the two moves nothing: linear
        return all_to_all(x, parallel_groups.expert, [row[me] for row in matrix], list(matrix[me]))
    nodes, per_node = topology.num_nodes, topology.ranks_per_node
    node, local = topology.node_of(me), topology.local_rank_of(me)
    rank = topology.rank_of
    by_dest = x.split(matrix[me])
    # stride copy: chunks ordered (dest local rank, dest node), so local rank g' gets one block
    send = torch.cat([by_dest[rank(n, g)] for g in range(per_node) for n in range(nodes)])
    send_splits = [sum(matrix[me][rank(n, g)] for n in range(nodes)) for g in range(per_node)]
    recv_splits = [sum(matrix[rank(node, gs)][rank(n, local)] for n in range(nodes)) for gs in range(per_node)]
    received = all_to_all(send, groups.intra_node, recv_splits, send_splits)
    # received: (source local rank gs, dest node n) -> stride copy to (dest node n, gs)
    sizes = [matrix[rank(node, gs)][rank(n, local)] for gs in range(per_node) for n in range(nodes)]
    pieces = received.split(sizes)
    send = torch.cat([pieces[gs * nodes + n] for n in range(nodes) for gs in range(per_node)])
    send_splits = [sum(matrix[rank(node, gs)][rank(n, local)] for gs in range(per_node)) for n in range(nodes)]
    recv_splits = [sum(matrix[rank(n, gs)][me] for gs in range(per_node)) for n in range(nodes)]
    # output: (source node, source local rank) = source rank order
    return all_to_all(send, groups.inter_node, recv_splits, send_splits)


# -- grouped pairwise exchange ---------------------------------------------------------------


def pairwise_peers(topology: Topology, rank: int, step: int) -> tuple[list[int], list[int]]:
    """(ranks this rank sends to, ranks it receives from) in ``step`` of the grouped exchange."""
    nodes = topology.num_nodes
    group = topology.node_of(rank)
    to_group, from_group = (group - step) % nodes, (group + step) % nodes
    members = range(topology.ranks_per_node)
    return [topology.rank_of(to_group, g) for g in members], [topology.rank_of(from_group, g) for g in members]


def pairwise_step(
    by_dest: Sequence[torch.Tensor], groups: ParallelGroups, matrix: SplitMatrix, step: int,
    wire_dtype: str = EXACT_WIRE,
) -> dict[int, torch.Tensor]:
    """Run one step: send this rank's chunks for the target group, return the chunks received,
    keyed by source rank (of the expert group), the rows travelling as ``wire_dtype`` says
    (:mod:`moeflow.comm.wire`). Zero-row messages are skipped on both sides (both know the sizes)."""
    if wire_dtype != EXACT_WIRE:  # encode what this step sends (and chunk 0, whose rows shape the receives)
        dtype, used = by_dest[0].dtype, {0, groups.rank, *pairwise_peers(groups.topology, groups.rank, step)[0]}
        encoded = [to_wire(wire_dtype, chunk) if dest in used else chunk for dest, chunk in enumerate(by_dest)]
        return {source: from_wire(wire_dtype, rows, dtype)
                for source, rows in pairwise_step(encoded, groups, matrix, step).items()}
    me = groups.rank
    send_to, receive_from = pairwise_peers(groups.topology, me, step)
    received: dict[int, torch.Tensor] = {}
    receives: list[tuple[torch.Tensor, int]] = []
    row_shape = by_dest[0].shape[1:]
    for source in receive_from:
        rows = matrix[source][me]
        if source == me:
            received[source] = by_dest[me]
        else:
            received[source] = by_dest[0].new_empty((rows, *row_shape))
            if rows:
                receives.append((received[source], groups.global_rank(source)))
    sends = [(by_dest[dest].contiguous(), groups.global_rank(dest)) for dest in send_to
             if dest != me and matrix[me][dest]]
    for request in send_and_receive(sends, receives, groups.expert):  # posted together: NCCL's order rule
        request.wait()
    return received


def _alltoall_pairwise(x: torch.Tensor, groups: ParallelGroups, matrix: SplitMatrix) -> torch.Tensor:
    by_dest = x.split(matrix[groups.rank])
    received: dict[int, torch.Tensor] = {}
    for step in range(groups.topology.num_nodes):
        received.update(pairwise_step(by_dest, groups, matrix, step))
    return torch.cat([received[source] for source in range(groups.size)])


class _PairwiseAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, groups: ParallelGroups, matrix: SplitMatrix) -> torch.Tensor:
        ctx.groups, ctx.matrix = groups, matrix
        return _alltoall_pairwise(x, groups, matrix)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        return _alltoall_pairwise(grad.contiguous(), ctx.groups, transpose(ctx.matrix)), None, None


# -- entry point ------------------------------------------------------------------------------


def all_to_all_with(
    algorithm: str,
    x: torch.Tensor,
    groups: ParallelGroups,
    input_splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
) -> torch.Tensor:
    """All-to-all over ``groups.expert`` with the named algorithm (differentiable). 2DH and pairwise
    need the expert group's node layout (``groups.knows_nodes``, ``groups.topology``)."""
    _check_algorithm(algorithm)
    group = _require_group(groups, algorithm)
    with groups.ledger.tracked("all-to-all", group, x.numel() * x.element_size()):
        return _all_to_all_with(algorithm, x, groups, group, input_splits, output_splits)


def _all_to_all_with(
    algorithm: str, x: torch.Tensor, groups: ParallelGroups, group: dist.ProcessGroup,
    input_splits: Sequence[int] | None, output_splits: Sequence[int] | None,
) -> torch.Tensor:
    if algorithm == "linear":
        out_splits = None if output_splits is None else list(output_splits)
        in_splits = None if input_splits is None else list(input_splits)
        return all_to_all(x, group, out_splits, in_splits)
    matrix = split_matrix(x, groups.size, input_splits, group)
    me = groups.rank
    expected = [matrix[source][me] for source in range(groups.size)]
    if output_splits is not None and list(output_splits) != expected:
        raise ValueError(f"output_splits {list(output_splits)} disagree with what peers send: {expected}")
    if algorithm == "2dh":
        return _alltoall_2dh(x.contiguous(), groups, matrix)
    return _PairwiseAllToAll.apply(x.contiguous(), groups, matrix)


def exchange(
    algorithm: str, x: torch.Tensor, groups: ParallelGroups, matrix: SplitMatrix | None = None,
    wire_dtype: str = EXACT_WIRE,
) -> torch.Tensor:
    """All-to-all over ``groups.expert`` with the named algorithm, outside autograd: equal splits,
    or ``matrix[s][d]`` rows from rank s to rank d, known to every rank (no all-gather of splits);
    the rows travel as ``wire_dtype`` says and come back in ``x``'s dtype (:mod:`moeflow.comm.wire`).

    For code that writes its own backward (the pipeline): the adjoint of an exchange is the same
    exchange over the transposed matrix (:func:`transpose`), so equal splits are their own
    adjoint. It runs as an all-to-all of ``groups.traffic`` (what Lina's gradient scheduler yields to).
    """
    _check_algorithm(algorithm)
    group = _require_group(groups, algorithm)
    return _on_the_wire(x, groups, group, wire_dtype,
                        lambda sent: _exchange_rows(algorithm, sent, groups, group, matrix))


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, x: torch.Tensor, algorithm: str, groups: ParallelGroups, matrix: SplitMatrix,
        wire_dtype: str,
    ) -> torch.Tensor:
        ctx.algorithm, ctx.groups, ctx.matrix, ctx.wire_dtype = algorithm, groups, matrix, wire_dtype
        return exchange(algorithm, x, groups, matrix, wire_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor):  # type: ignore[override]
        back = exchange(ctx.algorithm, grad.contiguous(), ctx.groups, transpose(ctx.matrix), ctx.wire_dtype)
        return back, None, None, None, None


def differentiable_exchange(
    algorithm: str, x: torch.Tensor, groups: ParallelGroups, matrix: SplitMatrix, wire_dtype: str = EXACT_WIRE
) -> torch.Tensor:
    """:func:`exchange` inside autograd: its backward sends the gradient rows back over the
    transposed matrix, in the same wire format (for code that does not write its own backward)."""
    return _Exchange.apply(x, algorithm, groups, matrix, wire_dtype)


def exchange_on(
    group: dist.ProcessGroup | None, x: torch.Tensor, groups: ParallelGroups, output_splits: list[int],
    input_splits: list[int], wire_dtype: str = EXACT_WIRE,
) -> torch.Tensor:
    """The linear all-to-all over ``group``, a subgroup of ``groups.expert`` (a node's ranks, or one
    local rank's on every node: :meth:`ParallelGroups.node_groups`), as :func:`exchange` runs it:
    outside autograd, the rows as ``wire_dtype`` says, tracked and yielded to as an all-to-all.
    None: a group of this rank alone, the rows kept (in the wire's precision, as sent)."""
    if group is None:
        with torch.no_grad():
            return from_wire(wire_dtype, to_wire(wire_dtype, x), x.dtype)
    return _on_the_wire(x, groups, group, wire_dtype,
                        lambda sent: linear_all_to_all(sent, group, output_splits, input_splits))


def _on_the_wire(
    x: torch.Tensor, groups: ParallelGroups, group: dist.ProcessGroup, wire_dtype: str,
    send: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    with torch.no_grad():
        sent = to_wire(wire_dtype, x)
        nbytes = sent.numel() * sent.element_size()
        with groups.traffic.running(x.device), groups.ledger.tracked("all-to-all", group, nbytes):
            received = send(sent)
        return from_wire(wire_dtype, received, x.dtype)


def _exchange_rows(
    algorithm: str, x: torch.Tensor, groups: ParallelGroups, group: dist.ProcessGroup, matrix: SplitMatrix | None
) -> torch.Tensor:
    if algorithm == "linear":
        if matrix is None:
            return linear_all_to_all(x, group, None, None)
        me = dist.get_rank(group)
        return linear_all_to_all(x, group, [row[me] for row in matrix], list(matrix[me]))
    matrix = split_matrix(x, groups.size, None) if matrix is None else matrix
    if algorithm == "2dh":
        return _alltoall_2dh(x.contiguous(), groups, matrix)
    return _alltoall_pairwise(x.contiguous(), groups, matrix)


def _require_group(groups: ParallelGroups, algorithm: str) -> dist.ProcessGroup:
    if groups.expert is None:
        raise ValueError("an all-to-all needs a process group; this ParallelGroups is single-process")
    if algorithm != "linear" and not groups.knows_nodes:
        raise ValueError(f"alltoall={algorithm!r} needs the expert group's node layout: {groups.node_layout_problem}; "
                         "or use alltoall='linear' on a custom group")
    return groups.expert
