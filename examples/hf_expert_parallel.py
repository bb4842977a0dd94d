"""Fine-tune a transformers MoE model under transformers' own expert parallelism, with moeflow moving
the tokens (``ep_implementation="moeflow"``).

Run it on 2 CPU processes (gloo)::

    torchrun --nproc-per-node 2 examples/hf_expert_parallel.py
    torchrun --nproc-per-node 2 examples/hf_expert_parallel.py --model DIR   # a model of your own

Without ``--model`` rank 0 saves a small Qwen3-MoE of random weights first. What it shows:

- ``import moeflow.hf`` registers ``"moeflow"`` in transformers' expert-parallel implementations;
  ``moeflow.hf.configure(...)`` sets how it moves tokens (here the defaults).
- ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W, ep_size=W,
  ep_implementation="moeflow"))``: transformers puts W-th of each MoE block's experts on every
  process and FSDP2 on the rest; the model, its router and its experts stay transformers' own.
- A plain training loop (each process its own batch of a fixed random "bigram language", AdamW),
  then greedy generation: every process generates as many tokens, so none waits on a collective
  the others skip.

The last line it prints is a JSON summary (first and last loss, the tokens generated).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.distributed as dist
import transformers
from transformers.distributed import DistributedConfig

import moeflow.hf


def small_model(directory: str, vocab: int) -> None:
    """A Qwen3-MoE of random weights: 8 experts, 2 per token, 2 layers."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def bigram_batch(successor: torch.Tensor, batch: int, sequence: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences where each token is followed by its one successor."""
    tokens = [torch.randint(0, len(successor), (batch,), generator=generator)]
    for _ in range(sequence - 1):
        tokens.append(successor[tokens[-1]])
    return torch.stack(tokens, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a transformers MoE model directory (default: a small one)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's environment says who is who
    rank, world = dist.get_rank(), dist.get_world_size()
    moeflow.hf.configure()  # the defaults: token_exchange="auto", the linear all-to-all, exact rows
    with tempfile.TemporaryDirectory() as own:
        shared = [args.model or own]
        dist.broadcast_object_list(shared)  # rank 0's folder
        if args.model is None and rank == 0:
            small_model(shared[0], vocab=64)
        dist.barrier()
        layout = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="moeflow")
        model = transformers.AutoModelForCausalLM.from_pretrained(shared[0], dtype=torch.float32,
                                                                  distributed_config=layout)
        dist.barrier()  # every process has read the folder before rank 0's goes
    vocab = model.config.vocab_size
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))  # the same language everywhere
    generator = torch.Generator().manual_seed(100 + rank)  # each process its own batches
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        ids = bigram_batch(successor, args.batch, args.sequence, generator)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    prompt = bigram_batch(successor, 1, 4, generator)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   do_sample=False)
    if rank == 0:
        print(json.dumps({"example": "hf_expert_parallel", "world_size": world, "steps": args.steps,
                          "first_loss": losses[0], "last_loss": losses[-1],
                          "new_tokens": generated.shape[1] - prompt.shape[1]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
