"""Train a small model of your own with a moeflow MoE layer inside, in a plain PyTorch loop with DDP.

Run it on 2 CPU processes (gloo), or as one process::

    torchrun --nproc-per-node 2 examples/train_loop.py
    python examples/train_loop.py --steps 50

``examples/train_loop_fsdp2.py`` is the same loop with FSDP2 instead of DDP.

The model is an embedding, one residual MoE feed-forward block and an output head, trained to
predict the next token of a fixed random "bigram language" (each token has one successor), so the
loss falls from ln(vocab) towards 0 within a few dozen steps. What it shows:

- ``MoELayer(config, group=...)``: the experts are split over the processes (expert parallelism)
  and tokens travel to their experts by all-to-all. The library never reads the environment: the
  script initializes ``torch.distributed``, reads its rank and world size from it, and hands the
  layer the group.
- The same seed on every process, as in any data-parallel script: the layer draws expert e from
  the seed and e, so the processes hold the experts one process would, each only its own.
- ``expert_data_parallel(model)``: DDP for the weights every process holds whole (the embedding,
  the gate, the head), the experts left out of it; an expert's gradient already sums the tokens
  every process sent it, and a hook scales it to the mean over the processes. A plain
  ``DistributedDataParallel(model)`` would average expert 0 with expert 2: the layer refuses it.
- ``clip_grad_norm_(model, max_norm)``: the norm of the whole model's gradient, every expert
  counted once (``torch.nn.utils.clip_grad_norm_`` would see only this process's experts).
- The layer's ``aux_loss`` (the load-balancing loss) added to the task loss.
- ``MoEMonitor(model)`` and one ``monitor.step()`` per step: every MoE layer's health (load per
  expert and its balance, dead experts, drops, the router's entropy, the all-to-all's share of the
  step) over every process's tokens, alerts in the log, and ``--metrics FILE`` (JSONL) or
  ``--tensorboard DIR`` to keep it.

The last line it prints is a JSON summary (first and last loss).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow import MoEConfig, MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import topology_from_environment
from moeflow.metrics import JsonlSink, MetricsSink, MoEMonitor, TensorBoardSink
from moeflow.training.data_parallel import clip_grad_norm_, expert_data_parallel


class TinyMoEModel(nn.Module):
    """Embedding -> x + MoE(LayerNorm(x)) -> linear head over the vocabulary."""

    def __init__(self, vocab: int, config: MoEConfig, groups: ParallelGroups) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, config.model_dim)
        self.norm = nn.LayerNorm(config.model_dim)
        self.moe = MoELayer(config, group=groups)
        self.head = nn.Linear(config.model_dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.moe(self.norm(x))  # (batch, sequence, model_dim) in and out
        return self.head(x)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per process and step (default 16)")
    parser.add_argument("--sequence", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    parser.add_argument("--model-dim", type=int, default=32, help="model dimension (default 32)")
    parser.add_argument("--hidden-dim", type=int, default=64, help="hidden size of each expert (default 64)")
    parser.add_argument("--num-experts", type=int, default=4,
                        help="experts of the MoE layer, a multiple of the process count (default 4)")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token goes to (default 2)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate (default 0.01)")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip the gradient's norm to this (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("--metrics", help="write the MoE's health, one JSON record per step, to this file")
    parser.add_argument("--tensorboard", help="write the MoE's health as TensorBoard event files under this folder")
    return parser.parse_args()


def start_processes() -> tuple[int, int, ParallelGroups]:
    """Join the job torchrun started (it sets RANK, WORLD_SIZE, MASTER_ADDR, ...), or, run without
    torchrun, a job of one process. Rank and world size come from torch.distributed itself."""
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend="gloo")
    else:
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The expert-parallel group: all processes. The topology (how many share a node) is what the
    # launcher says; an entry point like this one may read it, the library never does.
    groups = ParallelGroups(dist.group.WORLD, topology_from_environment(os.environ, world_size))
    return rank, world_size, groups


def batch_of_tokens(successor: torch.Tensor, args: argparse.Namespace, generator: torch.Generator):
    """Sequences of the bigram language: a random first token, then each token's successor."""
    tokens = torch.empty(args.batch, args.sequence + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=generator)
    for t in range(args.sequence):
        tokens[:, t + 1] = successor[tokens[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def train(args: argparse.Namespace, wrap: Callable[[nn.Module], nn.Module], example: str) -> None:
    """Build the model alike on every process, ``wrap`` it for data parallelism, train, report."""
    rank, world_size, groups = start_processes()
    if args.num_experts % world_size:
        raise SystemExit(f"--num-experts {args.num_experts} must be a multiple of the {world_size} processes")

    torch.manual_seed(args.seed)  # the same on every process: every weight starts as in one process
    config = MoEConfig(model_dim=args.model_dim, hidden_dim=args.hidden_dim, num_experts=args.num_experts,
                       top_k=args.top_k, parallel="expert")  # experts split over the group
    model = TinyMoEModel(args.vocab, config, groups)
    trained = wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    monitor = MoEMonitor(model, sinks=sinks(args) if rank == 0 else ())  # every MoE layer's health, per step

    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1234))  # the language
    data = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each process reads its own batches
    losses = []
    for step in range(1, args.steps + 1):
        inputs, targets = batch_of_tokens(successor, args, data)
        logits = trained(inputs)
        task_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss = task_loss + model.moe.aux_loss  # the balance loss, weighted by config.aux_loss_weight
        optimizer.zero_grad()
        loss.backward()
        norm = clip_grad_norm_(model, args.max_norm)  # a collective: every process calls it
        optimizer.step()
        health = monitor.step(step)  # a collective: every process calls it

        mean_loss = task_loss.detach().clone()
        dist.all_reduce(mean_loss)  # the task loss over all processes, for the log
        losses.append(mean_loss.item() / world_size)
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            moe = health.layers[0]  # every process's tokens
            print(f"step {step:4d}  loss {losses[-1]:.4f}  grad norm {float(norm):.3f}  "
                  f"tokens per expert {moe.tokens_per_expert}  load max/mean {moe.load_max_over_mean:.2f}  "
                  f"dropped {moe.dropped_share:.1%}  router entropy {moe.router_entropy:.2f}", flush=True)

    monitor.close()
    if rank == 0:
        moe = health.layers[0]
        print(json.dumps({"example": example, "world_size": world_size, "steps": args.steps,
                          "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4),
                          "load_max_over_mean": round(moe.load_max_over_mean, 4), "dropped_share": moe.dropped_share,
                          "router_entropy": round(moe.router_entropy, 4), "alerts": len(monitor.alerts.fired)}))
    dist.destroy_process_group()


def sinks(args: argparse.Namespace) -> list[MetricsSink]:
    """Where rank 0 writes the monitor's figures, as the flags ask."""
    chosen: list[MetricsSink] = []
    if args.metrics:
        chosen.append(JsonlSink(args.metrics))
    if args.tensorboard:
        chosen.append(TensorBoardSink(args.tensorboard))
    return chosen


def main() -> None:
    train(parse_args(), expert_data_parallel, "train_loop")


if __name__ == "__main__":
    main()
