"""Train a moeflow MoE transformer in pipeline stages, in your own loop, on a (pp, dp, ep) mesh.

Run it on 4 CPU processes (gloo): two stages, each on two processes that split its experts::

    torchrun --nproc-per-node 4 examples/pipeline_loop.py --pp 2 --ep 2
    torchrun --nproc-per-node 2 examples/pipeline_loop.py --pp 2 --schedule dualpipev

The task is the one of ``examples/train_loop.py``: next tokens of a fixed random "bigram language"
(each token has one successor), so the loss falls from ln(vocab) towards 0. What it shows:

- ``init_device_mesh(..., ("pp", "dp", "ep"))``: the processes as pipeline stages (outermost),
  copies of a stage, and expert-parallel ranks inside a stage. The script makes the mesh; the
  library reads no environment.
- ``pipeline_stages(config, mesh, schedule=...)``: this process builds only the blocks of its own
  stages (``pipeline.model``, under the whole model's names), initialised from the seed as the
  whole model would be, and runs them with torch.distributed.pipelining's schedule.
- ``pipeline.step(idx, targets)``: every micro-batch's forward and backward; the MoE layers' aux
  losses reach the gradient from every stage; the loss is the same on every process.
- ``pipeline.clip_gradients(max_norm)``: the whole model's gradient norm, over every stage.

Every process of a pipeline passes the same batch (the first stage reads the tokens, the last the
targets); each (dp, ep) rank reads its own. The last line it prints is a JSON summary.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from moeflow.models.transformer import TransformerConfig
from moeflow.pipeline import SCHEDULES, pipeline_stages


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks in a stage (default 1)")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="pipeline schedule")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches a step (default 4)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per data rank and step (default 8)")
    parser.add_argument("--sequence", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--vocab", type=int, default=32, help="vocabulary size (default 32)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--model-dim", type=int, default=32, help="model dimension (default 32)")
    parser.add_argument("--num-experts", type=int, default=4, help="experts per MoE layer (default 4)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    return parser.parse_args()


def bigram_batch(successor: torch.Tensor, args: argparse.Namespace, generator: torch.Generator):
    tokens = torch.empty(args.batch, args.sequence + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=generator)
    for t in range(args.sequence):
        tokens[:, t + 1] = successor[tokens[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    args = parse_args()
    dist.init_process_group(backend="gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...
    world_size = dist.get_world_size()
    if world_size % (args.pp * args.ep):
        raise SystemExit(f"{world_size} processes do not split into --pp {args.pp} x --ep {args.ep} x a dp size")
    mesh = init_device_mesh("cpu", (args.pp, world_size // (args.pp * args.ep), args.ep),
                            mesh_dim_names=("pp", "dp", "ep"))
    config = TransformerConfig.build(vocab_size=args.vocab, context=args.sequence, layers=args.layers, heads=2,
                                     model_dim=args.model_dim, hidden_dim=2 * args.model_dim,
                                     num_experts=args.num_experts, top_k=2, capacity_factor=0.0)
    pipeline = pipeline_stages(config, mesh, schedule=args.schedule, microbatches=args.microbatches,
                               batch_size=args.batch, seed=args.seed)
    optimizer = torch.optim.AdamW(pipeline.parameters(), lr=args.lr)

    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1234))
    data_rank = mesh.get_local_rank("dp") * args.ep + mesh.get_local_rank("ep")
    data = torch.Generator().manual_seed(args.seed * 1000 + data_rank)  # the same on every stage
    losses = []
    for step in range(1, args.steps + 1):
        idx, targets = bigram_batch(successor, args, data)
        losses.append(pipeline.step(idx, targets))
        norm = pipeline.clip_gradients(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0 and (step == 1 or step % 10 == 0):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  grad norm {norm:.3f}", flush=True)
    if dist.get_rank() == 0:
        print(json.dumps({"example": "pipeline_loop", "world_size": world_size, "schedule": args.schedule,
                          "blocks_here": sorted(pipeline.model.part.blocks), "steps": args.steps,
                          "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
