"""Where the time of one MoE layer's forward+backward goes on a GPU (run by scripts/gpu-check.sh).

Prints, per expert kernel, the step's wall time, the GPU's busy time within it (the rest is the
device waiting on the host: syncs and launches), and the kernels that took the most device time.
  python scripts/gpu_profile_layer.py [--experts 64 --model-dim 2048 --hidden-dim 1408 --tokens 8192 --top-k 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings

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
    parser.add_argument("--bias", action="store_true", help="experts with biases (Mixtral and Qwen-MoE have none)")
    args = parser.parse_args()
    for kernel in args.kernels:
        profile_layer(args, kernel)


def profile_layer(args: argparse.Namespace, kernel: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(args.model_dim, args.hidden_dim, args.experts, top_k=args.top_k, capacity_factor=1.0,
                     activation="swiglu", pipeline=1, alltoall="linear", expert_kernel=kernel,
                     bias=args.bias).cuda().bfloat16()
    x = torch.randn(args.tokens, args.model_dim, device="cuda", dtype=torch.bfloat16)
    upstream = torch.randn_like(x)

    def step() -> None:
        leaf = x.detach().requires_grad_()
        ((layer(leaf) * upstream).sum() + layer.aux_loss).backward()
        layer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(json.dumps({"syncs": kernel, "where": device_syncs(step)}))
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
    # the kernels' own rows: an operator's row repeats its kernels' time (summing all rows counted it twice)
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 3
    print(json.dumps({"profile": kernel, "wall_ms": round(sorted(walls)[2] * 1e3, 3),
                      "device_busy_ms": round(device_us / 1e3, 3), "stats": layer.last_stats.plan.kernels,
                      "source": layer.last_stats.plan.source}))
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    print("where the host's time goes (a blocking copy or sync shows here, not on the device):")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))

def device_syncs(step) -> dict[str, int]:
    """Where one step makes the host wait for the GPU (torch's sync debug mode), by the innermost
    moeflow line on the stack: each is a point where the device's queue drains."""
    where: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "moeflow" in f.filename or "scripts" in f.filename]
        site = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[::-1][:3])
        where[f"{site} ({str(message)[:40]})"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(where)


if __name__ == "__main__":
    main()
