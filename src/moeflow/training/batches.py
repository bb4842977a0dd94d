"""The tokens a training step and an evaluation read: a pure function of (seed, step), so a resumed
run repeats an uninterrupted one, and a run at another layout with the same global batch (batch size
times data-parallel replicas) reads the same tokens."""

from __future__ import annotations

import numpy as np
import torch


def data_replica(rank: int, world_size: int, mp_size: int) -> tuple[int, int]:
    """(this worker's data-parallel replica, the number of replicas): the ``mp_size`` workers of one
    tensor-parallel group hold the same tokens."""
    return rank // mp_size, world_size // mp_size


def require_windows(tokens: int, context: int, what: str, fix: str) -> None:
    """A stream must hold one window of context+1 tokens (the inputs and the shifted targets)."""
    if tokens <= context + 1:
        raise ValueError(f"{what} has {tokens} tokens, fewer than context+1={context + 1}; {fix}")


def token_windows(stream: np.ndarray, starts: list[int], context: int) -> torch.Tensor:
    """(len(starts), context+1) int64 tokens: the windows of ``stream`` that begin at ``starts``."""
    return torch.from_numpy(np.stack([np.asarray(stream[s : s + context + 1], dtype=np.int64) for s in starts]))


def training_batch(
    stream: np.ndarray, step: int, replica: int, replicas: int, seed: int, batch_size: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s ``batch_size`` rows of the step's global batch: ``batch_size * replicas``
    random windows of the whole stream drawn from (seed, step) alone, so that a checkpoint resumed
    at another split of the same global batch (P 2 x EP 2 as P 1 x EP 4 or one process) reads
    the same tokens, as Megatron's data-parallel sampler splits its global batch."""
    require_windows(stream.shape[0], context, "the training data", "use more data or a shorter context")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.shape[0] - context - 1, (batch_size * replicas,), generator=generator)
    tokens = token_windows(stream, starts[replica * batch_size : (replica + 1) * batch_size].tolist(), context)
    return tokens[:, :-1], tokens[:, 1:]


def validation_windows(stream: np.ndarray, count: int, context: int) -> list[int]:
    """Evenly spaced window starts over the validation stream: the same for any number of workers."""
    require_windows(stream.shape[0], context, "the validation split",
                    "use more data, a larger val_percent or a shorter context")
    span = stream.shape[0] - context - 1
    return [i * span // count for i in range(count)]
