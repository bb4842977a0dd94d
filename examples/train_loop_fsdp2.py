"""The loop of ``examples/train_loop.py`` with FSDP2 (``fully_shard``) instead of DDP.

Run it on 2 CPU processes (gloo), or as one process::

    torchrun --nproc-per-node 2 examples/train_loop_fsdp2.py
    python examples/train_loop_fsdp2.py --steps 50

``expert_fully_shard(model)`` shards every weight but the experts over the processes, as
torchtitan composes FSDP with expert parallelism: the embedding, the gate and the head are
DTensors, all-gathered for the forward and reduce-scattered after the backward, while each expert
stays whole on its own process (FSDP2 ignores it) and a hook scales its gradient to the mean over
the processes. FSDP2 broadcasts nothing: the same seed on every process makes the weights equal.
``clip_grad_norm_`` sums the sharded weights' norms over the processes and counts every expert once.

The last line it prints is a JSON summary (first and last loss).
"""

from __future__ import annotations

from torch import nn
from train_loop import parse_args, train  # the same model, data and loop, next to this file

from moeflow.training.data_parallel import expert_fully_shard


def shard(model: nn.Module) -> nn.Module:
    return expert_fully_shard(model)  # blocks=(...) would make each block its own FSDP unit


if __name__ == "__main__":
    train(parse_args(), shard, "train_loop_fsdp2")
