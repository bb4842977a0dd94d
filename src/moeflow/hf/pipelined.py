"""Pipelined chunks inside the transformers backend (PipeMoE III, Tutel 3.2): a block's routed rows
move and compute in ``degree`` chunks, chunk i's experts running while the dispatch of the chunks
after it and the combine of those before it travel.

Each rank's rows are laid out by destination rank; chunk c takes the c-th of ``degree`` near-equal
parts of every destination's block, so every rank knows every chunk's split matrix from the agreed
one (:func:`chunk_matrices`) and no further agreement runs. The communication runs on the groups'
communication worker (a thread on CPU, a stream on CUDA: :func:`moeflow.parallel.chunk_pipeline.overlap`),
the experts (the model's own, through transformers' experts interface) on the calling thread.

The backward is the same pipeline over the adjoints: each chunk's output gradient crosses back to the
experts' rank (the combine's adjoint), the chunk's experts run their backward there (the autograd
graph its forward kept), and the input and gate-weight gradients return (the dispatch's adjoint).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.algorithms import SplitMatrix, exchange, transpose
from moeflow.comm.groups import ParallelGroups
from moeflow.config import EXACT_WIRE
from moeflow.parallel.chunk_pipeline import overlap

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows, local expert ids, gate weights) -> one weighted sum per row: the rank's experts."""


def chunk_matrices(matrix: SplitMatrix, degree: int) -> list[SplitMatrix]:
    """Chunk c's rows from rank s to rank d: the c-th of ``degree`` near-equal parts of ``matrix[s][d]``."""
    return [[[rows * (c + 1) // degree - rows * c // degree for rows in row] for row in matrix]
            for c in range(degree)]


def chunk_rows(sizes_W: list[int], degree: int) -> list[torch.Tensor]:
    """The indices of this rank's rows (laid out by destination, ``sizes_W`` to each) in each chunk,
    by destination: what :func:`chunk_matrices` sends."""
    starts = [sum(sizes_W[:d]) for d in range(len(sizes_W))]
    return [torch.cat([torch.arange(start + rows * c // degree, start + rows * (c + 1) // degree)
                       for start, rows in zip(starts, sizes_W, strict=True)]) for c in range(degree)]


@dataclass(frozen=True)
class ChunkPlan:
    """How a block's rows travel in chunks: each chunk's split matrix, this rank's rows in it, and
    whether the ids and gate weights ride as extra columns of the rows (where that is exact)."""

    matrices: list[SplitMatrix]
    rows: list[torch.Tensor]
    algorithm: str
    wire_dtype: str
    groups: ParallelGroups
    packed: bool

    @classmethod
    def of(cls, matrix: SplitMatrix, degree: int, algorithm: str, wire_dtype: str, groups: ParallelGroups,
           packed: bool) -> ChunkPlan:
        return cls(chunk_matrices(matrix, degree), chunk_rows(matrix[groups.rank], degree), algorithm, wire_dtype,
                   groups, packed)

    def send(self, chunk: int, x: torch.Tensor, wire_dtype: str | None = None) -> torch.Tensor:
        """Chunk ``chunk``'s rows to their ranks (the dispatch, or a combine's adjoint)."""
        return exchange(self.algorithm, x.contiguous(), self.groups, self.matrices[chunk],
                        wire_dtype or self.wire_dtype)

    def send_back(self, chunk: int, x: torch.Tensor, wire_dtype: str | None = None) -> torch.Tensor:
        """Chunk ``chunk``'s rows back to the ranks they came from (the combine, or a dispatch's adjoint)."""
        return exchange(self.algorithm, x.contiguous(), self.groups, transpose(self.matrices[chunk]),
                        wire_dtype or self.wire_dtype)

    def with_columns(self, send: Callable[..., torch.Tensor], chunk: int, rows_NM: torch.Tensor,
                     columns_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and their extra columns (ids and gate weights, or the weights' gradients) through
        ``send``: one exchange where packed, else the rows in the wire format and the columns exact."""
        if self.packed:
            both = send(chunk, torch.cat([rows_NM, columns_NK.to(rows_NM.dtype)], dim=1))
            return both[:, :rows_NM.shape[1]], both[:, rows_NM.shape[1]:]
        return send(chunk, rows_NM), send(chunk, columns_NK.float(), EXACT_WIRE)


def pipelined(rows_NM: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, plan: ChunkPlan,
              experts: Experts, parameters: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Each row's weighted expert output, back at this rank in the rows' order, in chunks (the
    experts' graphs kept for a backward only where grad mode is on). ``parameters``: the experts',
    inputs of the graph so that their gradients are reached where nothing else needs one (frozen
    embeddings and router); the chunks' own backwards accumulate them."""
    return _Pipelined.apply(rows_NM, weights_NK, ids_NK, plan, experts, torch.is_grad_enabled(), *parameters)


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, rows_NM: torch.Tensor, weights_NK: torch.Tensor, ids_NK: torch.Tensor, plan: ChunkPlan,
        experts: Experts, keep_graphs: bool, *parameters: torch.Tensor,
    ) -> torch.Tensor:
        out_NM = rows_NM.new_empty(rows_NM.shape)
        graphs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        width = ids_NK.shape[1]

        def send(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
            index = plan.rows[chunk]
            slots = torch.cat([ids_NK[index].float(), weights_NK[index].float()], dim=1)  # the ids exact
            return plan.with_columns(plan.send, chunk, rows_NM[index], slots)

        def compute(chunk: int, received: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x_NM, slots = received
            ids, weights = slots[:, :width].round().long(), slots[:, width:].to(weights_NK.dtype)
            # the chunk's own graph, its tensors saved as they are: under activation checkpointing the
            # checkpoint's hooks would otherwise recompute the layer (its collectives) inside the backward
            with torch.set_grad_enabled(keep_graphs), torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
                x_NM, weights = x_NM.detach().requires_grad_(keep_graphs), weights.detach().requires_grad_(keep_graphs)
                y_NM = experts(x_NM, ids, weights)
            graphs.append((x_NM, weights, y_NM))
            return y_NM.detach()

        def receive(chunk: int, y_NM: torch.Tensor) -> None:
            out_NM[plan.rows[chunk]] = plan.send_back(chunk, y_NM)

        sends = [functools.partial(send, chunk) for chunk in range(len(plan.rows))]
        overlap(plan.groups, rows_NM.device, sends, compute, receive)  # type: ignore[arg-type]  # pieces: tuples
        ctx.plan, ctx.graphs, ctx.parameters = plan, graphs if keep_graphs else [], len(parameters)
        ctx.shapes = (rows_NM.shape, weights_NK.shape, weights_NK.dtype)
        return out_NM

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_NM: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, graphs = ctx.plan, ctx.graphs
        if len(graphs) != len(plan.rows):
            raise RuntimeError("the backend's pipelined chunks run one backward (their graphs are freed by it): for a "
                               "second backward (retain_graph=True) use moeflow.hf.configure(pipeline=1)")
        rows_shape, weights_shape, weights_dtype = ctx.shapes
        grad_rows_NM = grad_NM.new_zeros(rows_shape)
        grad_weights_NK = grad_NM.new_zeros(weights_shape, dtype=weights_dtype)

        def send(chunk: int) -> torch.Tensor:
            return plan.send(chunk, grad_NM[plan.rows[chunk]])  # the combine's adjoint

        def compute(chunk: int, grad_y_NM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x_NM, weights, y_NM = graphs[chunk]
            with torch.enable_grad():
                torch.autograd.backward(y_NM, grad_y_NM)  # the experts' weights accumulate theirs
            return (x_NM.grad if x_NM.grad is not None else torch.zeros_like(x_NM),
                    weights.grad if weights.grad is not None else torch.zeros_like(weights))

        def receive(chunk: int, grads: tuple[torch.Tensor, torch.Tensor]) -> None:
            index = plan.rows[chunk]
            rows, weights = plan.with_columns(plan.send_back, chunk, *grads)  # the dispatch's adjoint
            grad_rows_NM[index], grad_weights_NK[index] = rows, weights.to(weights_dtype)

        sends = [functools.partial(send, chunk) for chunk in range(len(plan.rows))]
        overlap(plan.groups, grad_NM.device, sends, compute, receive)  # type: ignore[arg-type]  # pieces: tuples
        ctx.graphs = []
        return (grad_rows_NM, grad_weights_NK, None, None, None, None, *[None] * ctx.parameters)
