"""Where the time of one MoE layer's forward+backward goes on a GPU (run by scripts/gpu-check.sh).

Prints, per expert kernel, the step's wall time, the GPU's busy time within it (the rest is the
device waiting on the host: syncs and launches), and the kernels that took the most device time.
  python scripts/gpu_profile_layer.py [--experts 64 --model-dim 2048 --hidden-dim 1408 --tokens 8192 --top-k 8]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moeflow import MoELayer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--model-dim", type=int, default=2048)
    parser.add_argument("--hidden-dim", type=int, default=1408)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--kernels", nargs="+", default=["ragged", "bmm"])
    parser.add_argument("--rows", type=int, default=22)
    args = parser.parse_args()
    for kernel in args.kernels:
        profile_layer(args, kernel)


def profile_layer(args: argparse.Namespace, kernel: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(args.model_dim, args.hidden_dim, args.experts, top_k=args.top_k, capacity_factor=1.0,
                     activation="swiglu", pipeline=1, alltoall="linear", expert_kernel=kernel).cuda().bfloat16()
    x = torch.randn(args.tokens, args.model_dim, device="cuda", dtype=torch.bfloat16)
    upstream = torch.randn_like(x)

    def step() -> None:
        leaf = x.detach().requires_grad_()
        ((layer(leaf) * upstream).sum() + layer.aux_loss).backward()
        layer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / 3
    print(json.dumps({"profile": kernel, "wall_ms": round(sorted(walls)[2] * 1e3, 3),
                      "device_busy_ms": round(device_us / 1e3, 3), "stats": layer.last_stats.plan.kernels,
                      "source": layer.last_stats.plan.source}))
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))

if __name__ == "__main__":
    main()
