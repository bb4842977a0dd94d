"""Overlapped, pipelined dispatch -> experts -> combine (Tutel 3.2, PipeMoE III).

Only the two all-to-alls and the experts between them are partitioned: the (E, C, M) dispatch
buffer is split along the capacity dimension into d chunks. On CPU one communication worker thread
(the CPU counterpart of a communication stream) runs the all-to-alls in issue order: the dispatch
of every chunk first, then each chunk's combine as soon as its experts are done, while the calling
thread computes the experts of the next chunk. gloo moves the bytes on its own threads and torch
ops release the GIL, so communication overlaps computation. On CUDA tensors the same order runs on
a communication stream beside the compute stream, ordered by events (:mod:`moeflow.comm.streams`):
a thread would only queue both kernels on one stream.

The backward is the same pipeline run on the output gradient, with the expert backward as the
compute step, over the exchange's ``adjoint()``: an equal-split all-to-all is its own adjoint, so for
expert parallelism the gradient of the combine is a dispatch and the gradient of the dispatch is a
combine (an exchange whose dispatch and combine are not each other's adjoint returns another exchange).

Each chunk's state (its received rows, its saved activations) lives in per-chunk records owned by
one autograd node, never on the layer: any number of chunks can be in flight. The experts' math is
an :class:`~moeflow.core.experts.ExpertCompute` (FFN, SwiGLU, with or without biases); the worker thread
belongs to the layer's :class:`~moeflow.comm.ParallelGroups`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, Self

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from moeflow.comm.algorithms import exchange
from moeflow.comm.groups import CommunicationWorker, ParallelGroups
from moeflow.comm.streams import Piece, overlap_on_streams
from moeflow.config import EXACT_WIRE
from moeflow.core.experts import ExpertCompute, FFNSaved, FFNWeightGradInputs, FFNWeights
from moeflow.core.stats import PipelineTiming
from moeflow.core.workspace import Workspace, buffer
from moeflow.kernels.saved_activations import save_with_records, saved_with_records
from moeflow.perf.pipeline import capacity_chunks


class ChunkExchange(Protocol):
    """How chunks travel between the (E, Cj, M) layout by destination expert and the rows of this
    rank's experts; ``groups`` supplies the communication worker."""

    @property
    def groups(self) -> ParallelGroups | None: ...

    @property
    def communicates(self) -> bool: ...

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor: ...

    def from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor: ...

    def chunk(self, start: int, stop: int) -> ChunkExchange:
        """The exchange of the capacity slots [start, stop) (a ragged one sends only their kept rows)."""
        ...

    def adjoint(self) -> ChunkExchange:
        """The exchange the backward runs: dispatch = the combine's adjoint, and the reverse."""
        ...


@dataclass(frozen=True)
class ExpertExchange:
    """How a chunk travels between the (E, Cj, M) layout by destination expert and the experts'
    (L, W*Cj, M) layout (Tutel's flexible all-to-all layout), for an expert-parallel placement
    over ``groups.expert``. ``groups=None`` or a one-rank group: tokens stay on this rank (one
    process, or replicated experts), and only the chunking remains. The rows travel as
    ``wire_dtype`` says (:mod:`moeflow.comm.wire`)."""

    groups: ParallelGroups | None
    algorithm: str
    num_local_experts: int
    wire_dtype: str = EXACT_WIRE

    @property
    def communicates(self) -> bool:
        return self.groups is not None and self.groups.size > 1

    def to_experts(self, chunk_ECM: torch.Tensor) -> torch.Tensor:
        if not self.communicates:
            return chunk_ECM.contiguous()
        assert self.groups is not None
        _, rows, model_dim = chunk_ECM.shape
        # by source: (W, L, rows, M)
        received = exchange(self.algorithm, chunk_ECM.contiguous(), self.groups, wire_dtype=self.wire_dtype)
        by_source_WLCM = received.view(self.groups.size, self.num_local_experts, rows, model_dim)
        return by_source_WLCM.transpose(0, 1).reshape(self.num_local_experts, self.groups.size * rows, model_dim)

    def adjoint(self) -> ExpertExchange:
        """The exchange of the backward: an equal-split exchange is its own adjoint."""
        return self

    def chunk(self, start: int, stop: int) -> ExpertExchange:
        """Every chunk moves the same way: all its slots."""
        return self

    def from_experts(self, y_LXM: torch.Tensor, rows: int) -> torch.Tensor:
        if not self.communicates:
            return y_LXM
        assert self.groups is not None
        world, model_dim = self.groups.size, y_LXM.shape[-1]
        by_source_WLCM = y_LXM.view(self.num_local_experts, world, rows, model_dim).transpose(0, 1)
        returned = exchange(self.algorithm, by_source_WLCM.contiguous(), self.groups, wire_dtype=self.wire_dtype)
        return returned.view(world * self.num_local_experts, rows, model_dim)


class SelfAdjointExchange:
    """A communicating exchange whose dispatch and combine are each other's adjoint, so the backward
    runs the same exchange."""

    @property
    def communicates(self) -> bool:
        return True

    def adjoint(self) -> Self:
        return self

    def chunk(self, start: int, stop: int) -> Self:
        return self


def pad_slots(chunk_ECM: torch.Tensor, multiple: int) -> torch.Tensor:
    """The chunk with empty slots appended until its slot count is a multiple of ``multiple`` (for
    exchanges that split a chunk's slots over several ranks); the exchange drops them again."""
    rows = chunk_ECM.shape[1]
    padded = padded_slots(rows, multiple)
    return chunk_ECM if padded == rows else F.pad(chunk_ECM, (0, 0, 0, padded - rows))


def padded_slots(rows: int, multiple: int) -> int:
    return -(-rows // multiple) * multiple


def _without_grad(function: Callable[..., object], *args: object) -> object:
    with torch.no_grad():  # grad mode is per thread and on by default in a new one
        return function(*args)


def run_pipeline(
    buffer_ECM: torch.Tensor,
    chunks: list[tuple[int, int]],
    compute: Callable[[int, torch.Tensor], torch.Tensor],
    chunk_exchange: ChunkExchange,
    after_compute: Callable[[], None] | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """out[:, a:b] = from_experts(compute(i, to_experts(buffer[:, a:b]))) for each chunk (a, b).

    With more than one chunk and a process group, communication runs on the communication worker
    while ``compute`` runs on the caller's thread; chunk i's experts overlap the dispatch of the
    chunks after it and the combine of the chunks before it. One chunk that stays on this rank
    is returned as ``compute`` made it, with no copy.
    """
    if len(chunks) == 1 and not chunk_exchange.communicates:
        out_ECM = compute(0, chunk_exchange.chunk(0, buffer_ECM.shape[1]).to_experts(buffer_ECM))
        if after_compute is not None:
            after_compute()
        return out_ECM
    out_ECM = buffer(workspace, buffer_ECM.shape, buffer_ECM)

    def send(start: int, stop: int) -> torch.Tensor:
        return chunk_exchange.chunk(start, stop).to_experts(buffer_ECM[:, start:stop])

    def receive(y_LXM: torch.Tensor, start: int, stop: int) -> None:
        out_ECM[:, start:stop] = chunk_exchange.chunk(start, stop).from_experts(y_LXM, stop - start)

    if len(chunks) == 1 or not chunk_exchange.communicates:
        for index, (start, stop) in enumerate(chunks):
            receive(compute(index, send(start, stop)), start, stop)
        if after_compute is not None:
            after_compute()
        return out_ECM

    assert chunk_exchange.groups is not None
    overlap(
        chunk_exchange.groups, buffer_ECM.device, [functools.partial(send, start, stop) for start, stop in chunks],
        compute,
        lambda index, y_LXM: receive(y_LXM, *chunks[index]), after_compute,
    )
    return out_ECM


def overlap(
    groups: ParallelGroups, device: torch.device, sends: list[Callable[[], Piece]],
    compute: Callable[[int, Piece], Piece], receive: Callable[[int, Piece], None],
    after_compute: Callable[[], None] | None = None,
) -> None:
    """Sends, computes and receives overlapped: on CUDA tensors on the groups' communication stream
    (:mod:`moeflow.comm.streams`), on CPU on their communication worker thread."""
    if device.type == "cuda":
        overlap_on_streams(groups.streams.on(device), torch.cuda.current_stream(device), sends, compute, receive,
                           after_compute)
    else:
        overlap_on_worker(groups.worker, sends, compute, receive, after_compute)


def overlap_on_worker(
    worker: CommunicationWorker, sends: list[Callable[[], Piece]],
    compute: Callable[[int, Piece], Piece], receive: Callable[[int, Piece], None],
    after_compute: Callable[[], None] | None = None,
) -> None:
    """The overlap both pipelines share: every send on the communication worker, in order; each
    piece's compute on the calling thread as soon as its send is done, then its receive queued
    behind the sends; ``after_compute`` runs while the last receives are in flight."""
    dispatched: list[Future] = [worker.submit(_without_grad, send) for send in sends]
    combined: list[Future] = []
    try:
        for index, future in enumerate(dispatched):
            combined.append(worker.submit(_without_grad, receive, index, compute(index, future.result())))
        if after_compute is not None:
            after_compute()
        for future in combined:
            future.result()
    except BaseException:
        for future in dispatched + combined:
            future.cancel()
        raise


def _record_experts(chunk_exchange: ChunkExchange, began: float) -> float:
    """Seconds since ``began`` of an expert chunk's compute, also drawn on the job's timeline."""
    stopped = time.perf_counter()
    if chunk_exchange.groups is not None:
        chunk_exchange.groups.traffic.timeline.record("experts", began, stopped)
    return stopped - began


class _PipelinedExperts(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, buffer_ECM: torch.Tensor, chunk_exchange: ChunkExchange, chunks: list[tuple[int, int]],
        timing: PipelineTiming, compute: ExpertCompute, workspace: Workspace | None, for_backward: bool,
        scale_LWC: torch.Tensor | None, *weight_tensors: torch.Tensor | None,
    ) -> torch.Tensor:
        start = timing.now()
        weights = FFNWeights(*weight_tensors)
        saved: list[FFNSaved | None] = [None] * len(chunks)
        outputs: list[torch.Tensor | None] = [None] * len(chunks)  # unscaled outputs, for the scale's gradient

        def expert_forward(index: int, x_LXM: torch.Tensor) -> torch.Tensor:
            begin = time.perf_counter()
            y_LXM, saved[index] = compute.chunk(*chunks[index]).forward(x_LXM, weights, workspace)
            if scale_LWC is not None:
                outputs[index] = y_LXM if for_backward else None
                y_LXM = _scaled(y_LXM, scale_LWC, chunks[index])
            timing.expert_forward_s += _record_experts(chunk_exchange, begin)
            return y_LXM

        out_ECM = run_pipeline(buffer_ECM.contiguous(), chunks, expert_forward, chunk_exchange, workspace=workspace)
        # without a backward to read them, the activations' buffers are free at once
        save_with_records(ctx, weight_tensors, saved if for_backward else [])
        ctx.chunk_exchange, ctx.chunks, ctx.timing = chunk_exchange, chunks, timing
        ctx.compute, ctx.workspace = compute, workspace
        ctx.scale_LWC, ctx.outputs = (scale_LWC.detach(), outputs) if scale_LWC is not None else (None, None)
        timing.forward_s = timing.now() - start
        return out_ECM

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out_ECM: torch.Tensor):  # type: ignore[override]
        start = ctx.timing.now()
        weight_tensors, saved = saved_with_records(ctx)
        weights = FFNWeights(*weight_tensors)
        compute: ExpertCompute = ctx.compute
        workspace: Workspace | None = ctx.workspace
        pending: list[FFNWeightGradInputs] = []
        totals: list[torch.Tensor | None] = [None] * len(weight_tensors)
        scale_LWC: torch.Tensor | None = ctx.scale_LWC
        grad_scale_LWC = None if scale_LWC is None else torch.zeros_like(scale_LWC)

        def expert_backward(index: int, grad_y_LXM: torch.Tensor) -> torch.Tensor:
            begin = time.perf_counter()
            if scale_LWC is not None:  # y' = s y: ds = <y, dy'>, dy = s dy'
                start, stop = ctx.chunks[index]
                dots_LX = (ctx.outputs[index] * grad_y_LXM).sum(-1)
                grad_scale_LWC[:, :, start:stop] = dots_LX.view(*scale_LWC.shape[:2], stop - start)
                ctx.outputs[index] = None
                grad_y_LXM = _scaled(grad_y_LXM, scale_LWC, ctx.chunks[index])
            grad_x_LXM, weight_inputs = compute.chunk(*ctx.chunks[index]).backward_input(
                saved[index], grad_y_LXM, weights, workspace
            )
            pending.append(weight_inputs)
            ctx.timing.expert_backward_s += _record_experts(ctx.chunk_exchange, begin)
            return grad_x_LXM

        def weight_gradients() -> None:
            # deferred: full-size GEMMs, off the critical path, overlapping the last combines
            begin = time.perf_counter()
            totals[:] = compute.weight_grads(type(pending[0]).concat(pending, workspace), weights, workspace)
            pending.clear()  # the chunks' activations and their gradients are free from here
            ctx.timing.expert_backward_s += time.perf_counter() - begin

        grad_buffer_ECM = run_pipeline(
            grad_out_ECM.contiguous(), ctx.chunks, expert_backward, ctx.chunk_exchange.adjoint(),
            after_compute=weight_gradients, workspace=workspace,
        )
        ctx.timing.backward_s = (ctx.timing.backward_s or 0.0) + ctx.timing.now() - start
        return grad_buffer_ECM, None, None, None, None, None, None, grad_scale_LWC, *totals


def _scaled(rows_LXM: torch.Tensor, scale_LWC: torch.Tensor, chunk: tuple[int, int]) -> torch.Tensor:
    """A chunk's (L, W * Cj, M) rows, each times its scale (the chunk's slots of ``scale_LWC``)."""
    start, stop = chunk
    local, world = scale_LWC.shape[:2]
    by_source = rows_LXM.view(local, world, stop - start, rows_LXM.shape[-1])
    scale = scale_LWC[:, :, start:stop].unsqueeze(-1).to(rows_LXM.dtype)
    return (by_source * scale).view(rows_LXM.shape)


def pipelined_experts(
    buffer_ECM: torch.Tensor, compute: ExpertCompute, weights: FFNWeights, chunk_exchange: ChunkExchange, degree: int,
    timing: PipelineTiming | None = None, workspace: Workspace | None = None, scale_LWC: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch -> experts -> combine of an (E, C, M) buffer in ``degree`` capacity chunks; returns
    the combined (E, C, M) buffer. Differentiable in the buffer, the expert weights and ``scale_LWC``:
    a scale of each output row in the experts' layout (L, W, C) applied before the combine (the gate
    weights of an exchange that sums a token's outputs before they travel). With a ``workspace`` the
    experts' intermediates reuse its buffers."""
    chunks = capacity_chunks(buffer_ECM.shape[1], degree)
    tensors = weights.as_tuple()
    for_backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (buffer_ECM, scale_LWC, *tensors)
    )
    return _PipelinedExperts.apply(
        buffer_ECM, chunk_exchange, chunks, timing if timing is not None else PipelineTiming(), compute, workspace,
        for_backward, scale_LWC, *tensors,
    )
