"""A layer's forward and backward captured in CUDA graphs (``torch.cuda.make_graphed_callables``).

On a GPU a 64-expert layer issues about a hundred kernels a step, and the host's time to queue
them, with moeflow's Python around them, left the device idle for a third of the step
(docs/benchmarks/2026-11-27-gpu-host.md). A captured step replays every kernel with one launch
from the host. Capture needs a step whose shapes and addresses never change and that never waits
for the device: the static step (``step_shapes="static"``, :mod:`moeflow.parallel.dispatchers.static`).
Replays run no Python of the layer's: its aux loss comes out of the graph as a second output, and its
statistics are the captured step's, read from the graph's own counts after each replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moeflow.moe.forward_memory import GraphValue
from moeflow.moe.layer import MoELayer


class _WithAuxLoss(nn.Module):
    """The layer's output and its aux loss, both outputs of the graph (a replay runs no Python, so
    the loss must leave the graph to carry its gradient)."""

    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.layer(x)
        return y, self.layer.aux_loss


def graphed_layer(
    layer: MoELayer, sample_x: torch.Tensor, warmup_steps: int = 3
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``layer``'s training step on inputs shaped as ``sample_x`` (and alike in requiring grad),
    captured: call the result as the layer. ``warmup_steps`` forwards and backwards run first, as
    ``make_graphed_callables`` asks (they move a loss-free balancing bias as steps would, and leave
    the parameters' gradients alone). Another shape needs another capture."""
    config = layer.config
    if config.step_shapes == "dynamic" or config.capacity_factor <= 0 or layer.world_size > 1:
        raise ValueError(f"graphed_layer needs the static step: one rank, capacity_factor > 0 and step_shapes "
                         f"'static' or 'auto' (this layer: {layer.world_size} ranks, capacity_factor="
                         f"{config.capacity_factor}, step_shapes={config.step_shapes!r})")
    if not sample_x.is_cuda:
        raise ValueError(f"graphed_layer captures a step on a GPU: sample_x is a {sample_x.device.type} tensor, "
                         "not a CUDA tensor; on a CPU call the layer itself")
    if not layer.training:
        raise ValueError("graphed_layer captures a training step: call layer.train() first")
    sample = sample_x.detach().requires_grad_(sample_x.requires_grad)
    graphed = torch.cuda.make_graphed_callables(_WithAuxLoss(layer), (sample,), num_warmup_iters=warmup_steps)
    captured_stats = layer._last.stats  # reads the graph's own counts, which each replay rewrites

    def step(x: torch.Tensor) -> torch.Tensor:
        y, aux_loss = graphed(x)
        layer._last.aux_loss, layer._last.stats = GraphValue(aux_loss), captured_stats
        return y

    return step
