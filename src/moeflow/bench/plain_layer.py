"""MoELayer in a plain user script: no moeflow entry point, so no allocator tuning unless --tuned.

    python -m moeflow.bench.plain_layer            # the stock glibc allocator, as a user's script has it
    python -m moeflow.bench.plain_layer --tuned    # after moeflow.runtime.tune_cpu_allocator()

One thread, fp32, T=4096, M=512, k=2, capacity factor 1, forward+backward, at (E=8, H=2048) and
(E=64, H=256). moeflow, the Mixtral-style reference loop and a 2048^2 matmul (the machine's rate,
which gives the FLOP floor) run round-robin; medians. Each JSON line also holds the user and
system (kernel) CPU seconds per moeflow step, from getrusage around the moeflow runs alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

SHAPES = ((8, 2048), (64, 256))  # (num_experts, hidden_dim)
MATMUL = 2048


def _step(module: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> None:
    x = x.detach().requires_grad_()
    y = module(x)  # the upstream gradient goes in directly: no loss arithmetic inside the timing
    torch.autograd.backward([y, module.aux_loss], [upstream, torch.ones_like(module.aux_loss)])
    module.zero_grad(set_to_none=True)


def _cpu_seconds() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def measure(num_experts: int, hidden_dim: int, tokens: int, model_dim: int, repeats: int) -> dict[str, object]:
    from moeflow import MoELayer
    from moeflow.core.experts import ffn_flops
    from moeflow.reference import ReferenceMoE

    torch.manual_seed(0)
    reference = ReferenceMoE(model_dim, hidden_dim, num_experts, top_k=2, capacity_factor=1.0)
    layer = MoELayer(model_dim, hidden_dim, num_experts, top_k=2, capacity_factor=1.0, pipeline=1)
    layer.load_state_dict(reference.state_dict())  # one process: the full state (also on older commits)
    x = torch.randn(tokens, model_dim)
    upstream = torch.randn(tokens, model_dim)
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    samples: dict[str, list[float]] = {"moeflow": [], "reference": [], "matmul": []}
    cpu = {"user": 0.0, "system": 0.0}
    for round_index in range(repeats + 1):  # round 0 warms up
        for name, run in (("moeflow", lambda: _step(layer, x, upstream)),
                          ("reference", lambda: _step(reference, x, upstream)),
                          ("matmul", lambda: torch.mm(a, b))):
            user0, system0 = _cpu_seconds()
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            user1, system1 = _cpu_seconds()
            if round_index:
                samples[name].append(elapsed)
                if name == "moeflow":
                    cpu["user"] += (user1 - user0) / repeats
                    cpu["system"] += (system1 - system0) / repeats
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rate = 2 * MATMUL**3 / medians["matmul"]
    floor = ffn_flops(2 * tokens, model_dim, hidden_dim, "gelu", backward=True) / rate
    return {
        "bench": "plain_layer", "experts": num_experts, "hidden_dim": hidden_dim, "tokens": tokens,
        "model_dim": model_dim, "moeflow_ms": medians["moeflow"] * 1e3, "reference_ms": medians["reference"] * 1e3,
        "floor_ms": floor * 1e3, "ratio_to_floor": medians["moeflow"] / floor,
        "speedup_vs_reference": medians["reference"] / medians["moeflow"],
        "user_s_per_step": cpu["user"], "system_s_per_step": cpu["system"], "matmul_gflops": rate / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuned", action="store_true", help="call moeflow.runtime.tune_cpu_allocator() first")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    parser.add_argument("--model-dim", type=int, default=512, help="model dimension M")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (medians)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tuned = False
    if args.tuned:
        from moeflow.runtime import tune_cpu_allocator

        tuned = tune_cpu_allocator()
    results = []
    for num_experts, hidden_dim in SHAPES:
        result = {**measure(num_experts, hidden_dim, args.tokens, args.model_dim, args.repeats), "malloc_tuned": tuned}
        results.append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps({
        "summary": "plain_layer", "malloc_tuned": tuned,
        "ratio_to_floor": {f"E{r['experts']}-H{r['hidden_dim']}": round(r["ratio_to_floor"], 3) for r in results},
        "system_share": {f"E{r['experts']}-H{r['hidden_dim']}":
                         round(r["system_s_per_step"] / (r["user_s_per_step"] + r["system_s_per_step"]), 3)
                         for r in results},
    }), flush=True)


if __name__ == "__main__":
    main()
