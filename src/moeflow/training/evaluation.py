"""Validation loss: a fixed set of windows split over the workers, under the run's precision."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeflow.kernels.precision import DTYPES
from moeflow.models import TrainableLM
from moeflow.training.batches import token_windows, validation_windows
from moeflow.training.config import TrainConfig
from moeflow.training.gradients import all_reduce_sum


def autocast(config: TrainConfig, device: torch.device) -> torch.autocast:
    """--dtype bf16/fp16: the forward under autocast; the parameters stay fp32 (master weights)."""
    dtype = DTYPES[config.dtype]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@torch.no_grad()
def evaluate(
    model: TrainableLM, stream: np.ndarray, config: TrainConfig, rank: int, world_size: int,
    group: dist.ProcessGroup | None, device: torch.device,
) -> float:
    """Mean validation cross-entropy over a fixed set of windows, split over the workers (every
    worker runs the same number of forwards; padding windows carry zero weight)."""
    starts = validation_windows(stream, config.eval_windows, config.context)
    mine = starts[rank::world_size]
    per_worker = math.ceil(len(starts) / world_size)
    weights = [1.0] * len(mine) + [0.0] * (per_worker - len(mine))
    mine = mine + [starts[0]] * (per_worker - len(mine))
    was_training = model.training
    model.eval()
    total = count = 0.0
    for begin in range(0, per_worker, config.batch_size):
        windows = token_windows(stream, mine[begin : begin + config.batch_size], config.context).to(device)
        with torch.no_grad(), autocast(config, device):  # no graph: nothing is kept for a backward
            logits, _ = model(windows[:, :-1])
        losses = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten(), reduction="none")
        weight = torch.tensor(weights[begin : begin + config.batch_size], device=device).repeat_interleave(
            config.context
        )
        total += float((losses * weight).sum())
        count += float(weight.sum())
    model.train(was_training)
    total, count = all_reduce_sum([total, count], group, device, model.groups.ledger)
    return total / count
