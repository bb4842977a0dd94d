"""The tokens a training step and an evaluation read: a pure function of (seed, step, rank), so a
resumed run repeats an uninterrupted one."""

from __future__ import annotations

import numpy as np
import torch


def shard_of(stream: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This worker's contiguous part of the training stream."""
    size = stream.shape[0]
    return stream[rank * size // world_size : (rank + 1) * size // world_size]


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
    shard: np.ndarray, step: int, rank: int, seed: int, batch_size: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of the shard; a pure function of (seed, step, rank)."""
    require_windows(shard.shape[0], context, "a worker's share of the training data",
                    "use more data, a shorter context or fewer workers")
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    starts = torch.randint(0, shard.shape[0] - context - 1, (batch_size,), generator=generator).tolist()
    tokens = token_windows(shard, starts, context)
    return tokens[:, :-1], tokens[:, 1:]


def validation_windows(stream: np.ndarray, count: int, context: int) -> list[int]:
    """Evenly spaced window starts over the validation stream: the same for any number of workers."""
    require_windows(stream.shape[0], context, "the validation split",
                    "use more data, a larger val_percent or a shorter context")
    span = stream.shape[0] - context - 1
    return [i * span // count for i in range(count)]
