"""DualPipe's overlap: one micro-batch's forward on one of a rank's two stages run beside another
micro-batch's backward on the other, so that each one's all-to-alls wait while the other computes.

torch's DualPipeV runtime hands each pair to the function registered for ``OVERLAP_F_B`` (a forward
sub-action and a full backward, on the rank's two stages of its V); without one it runs the two one
after the other, which is the reference the overlapped run equals. :func:`run_side_by_side` runs the
backward in a second thread while the calling thread runs the forward: on gloo a thread blocked in
a collective or a receive holds no interpreter lock, and torch's kernels release it, so one
micro-batch's dispatch and combine (or their transposes in the backward) run while the other's
attention and experts compute.

Collectives never mis-pair: the rank's two stages' MoE layers communicate over two expert groups of
the same ranks (:meth:`~moeflow.comm.groups.ParallelGroups.over`, made up front by every rank), and
torch's schedule always pairs a forward on one stage with a backward on the other, so each group's
collectives are issued by one thread at a time, in the schedule's order, the same on every rank of
the group. The two stages hold different blocks, so no layer runs in both threads; the tied
embedding's gradient is written by the backward thread alone.

The bookkeeping is torch's for ``FORWARD`` and ``FULL_BACKWARD`` (its runtime's ``_perform_action``,
torch 2.13): the pending receives waited on, the last stage's loss computed and later found, the
backward counted, a stage's input handed locally to its neighbour on this rank. It reads the
runtime's private state: the project pins its torch, and a test runs the pair against the runtime's
own sequential path.
"""

from __future__ import annotations

import threading
from typing import Any

from torch.distributed.pipelining.schedules import _Action, _PipelineContext, _wait_batch_p2p


def run_side_by_side(action: _Action, ctx: _PipelineContext) -> None:
    """Run ``action``'s forward here and its backward in a second thread, together; raise what
    either raised (after both ended: each ends, at worst, at its collectives' timeout)."""
    if action.sub_actions is None or len(action.sub_actions) != 2:
        raise AssertionError(f"an OVERLAP_F_B action pairs a forward and a backward, got {action}")
    forward, backward = action.sub_actions
    runtime = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in runtime._stages}
    _wait_for_inputs(runtime, stages, forward, backward)
    failures: list[BaseException] = []

    def backward_thread() -> None:
        try:
            _backward(runtime, stages, backward)
        except BaseException as error:  # re-raised in the calling thread
            failures.append(error)

    thread = threading.Thread(target=backward_thread, name=f"pipeline {backward}", daemon=True)
    thread.start()
    try:
        _forward(runtime, stages, forward, ctx)
    finally:
        thread.join()
    if failures:
        raise failures[0]


def _wait_for_inputs(runtime: Any, stages: dict[int, Any], forward: _Action, backward: _Action) -> None:
    """The forward's activation and the backward's gradient, where they come from another rank."""
    forward_stage, backward_stage = stages[forward.stage_index], stages[backward.stage_index]
    if not forward_stage.is_first and forward.stage_index - 1 not in stages:
        _wait_batch_p2p(runtime.fwd_recv_ops.pop((forward.stage_index, forward.microbatch_index)))
    if not backward_stage.is_last and backward.stage_index + 1 not in stages:
        _wait_batch_p2p(runtime.bwd_recv_ops.pop((backward.stage_index, backward.microbatch_index)))


def _forward(runtime: Any, stages: dict[int, Any], action: _Action, ctx: _PipelineContext) -> None:
    index, microbatch = action.stage_index, action.microbatch_index
    assert ctx.arg_mbs is not None and ctx.kwarg_mbs is not None and microbatch is not None
    stage = stages[index]
    output = stage.forward_one_chunk(microbatch, ctx.arg_mbs[microbatch], ctx.kwarg_mbs[microbatch])
    runtime._maybe_compute_loss(stage, output, ctx.target_mbs, microbatch)
    if index + 1 in stages:  # the V's turn on this rank: no send
        stages[index + 1].set_local_fwd_input(output, microbatch)


def _backward(runtime: Any, stages: dict[int, Any], action: _Action) -> None:
    index, microbatch = action.stage_index, action.microbatch_index
    stage = stages[index]
    loss = runtime._maybe_get_loss(stage, microbatch)
    runtime.backward_counter[index] += 1
    last = runtime.backward_counter[index] == runtime._n_microbatches
    stage.backward_one_chunk(microbatch, loss=loss, full_backward=True, last_backward=last)
    if index - 1 in stages:
        stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(microbatch), microbatch)
