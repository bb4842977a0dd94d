"""A feasibility probe for issue 76 (run on a CUDA machine): how close a static-shape MoE step comes
to its GEMM floor, eager and captured in a CUDA graph, in plain torch (no moeflow code).

The step has no host read: capacity comes from the factor, every one of the T*k choices is placed
(dropped ones into a dump row with weight 0), so its shapes are fixed and it can be captured.
Prints one JSON object per measurement and a summary line."""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F


def static_moe(x: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
               k: int, capacity: int) -> torch.Tensor:
    tokens, model_dim = x.shape
    experts = w1.shape[0]
    probs = (x @ gate).float().softmax(-1)
    weight, expert = probs.topk(k, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)
    flat = expert.reshape(-1)
    onehot = F.one_hot(flat, experts)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)
    kept = position < capacity
    dump = experts * capacity
    slot = torch.where(kept, flat * capacity + position, dump)
    token = torch.arange(tokens * k, device=x.device) // k
    slot_token = torch.full((dump + 1,), tokens, device=x.device, dtype=torch.long)
    slot_token.scatter_(0, slot, token)
    padded_x = torch.cat([x, x.new_zeros(1, model_dim)])
    routed = padded_x[slot_token[:dump]].view(experts, capacity, model_dim)
    hidden = F.silu(torch.bmm(routed, w1)) * torch.bmm(routed, w3)
    out = torch.bmm(hidden, w2).view(dump, model_dim)
    out = torch.cat([out, out.new_zeros(1, model_dim)])
    combined = out[slot].view(tokens, k, model_dim) * (weight * kept.view(tokens, k)).to(x.dtype).unsqueeze(-1)
    return combined.sum(1)


def timed(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(experts: int, model_dim: int, hidden_dim: int, tokens: int, k: int, factor: float) -> dict:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    capacity = math.ceil(tokens * k / experts * factor)

    def param(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, device=dev, dtype=dt) * 0.02)

    gate, w1, w3, w2 = param(model_dim, experts), param(experts, model_dim, hidden_dim), \
        param(experts, model_dim, hidden_dim), param(experts, hidden_dim, model_dim)
    params = [gate, w1, w3, w2]
    x = torch.randn(tokens, model_dim, device=dev, dtype=dt, requires_grad=True)
    bx = torch.randn(experts, capacity, model_dim, device=dev, dtype=dt)

    def floor() -> None:
        leaf = bx.detach().requires_grad_()
        torch.bmm(F.silu(torch.bmm(leaf, w1)) * torch.bmm(leaf, w3), w2).sum().backward()

    def eager() -> None:
        static_moe(x, gate, w1, w3, w2, k, capacity).float().sum().backward()

    results = {"floor_ms": timed(floor), "eager_ms": timed(eager)}

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.w1, self.w3, self.w2 = gate, w1, w3, w2

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return static_moe(inp, self.gate, self.w1, self.w3, self.w2, k, capacity)

    try:
        graphed = torch.cuda.make_graphed_callables(Layer(), (x.detach().clone().requires_grad_(),))
        results["graphed_layer_ms"] = timed(lambda: graphed(x).float().sum().backward())
    except Exception as error:
        results["graphed_layer_error"] = repr(error)[:300]
    try:
        for p in params:
            p.grad = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(stream)
        for p in params:
            p.grad = None
        x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        results["captured_step_ms"] = timed(graph.replay)
    except Exception as error:
        results["captured_step_error"] = repr(error)[:300]
    with torch.no_grad():
        probs = (x @ gate).float().softmax(-1)
        counts = torch.bincount(probs.topk(k, -1).indices.reshape(-1), minlength=experts)
        results["dropped_share"] = float((counts - capacity).clamp(min=0).sum() / (tokens * k))
    return results


def main() -> None:
    shapes = {"qwen": (64, 2048, 1408, 8192, 8), "mixtral": (8, 4096, 14336, 8192, 2)}
    summary = {}
    for name, shape in shapes.items():
        for factor in (1.0, 1.25):
            r = measure(*shape, factor)
            r.update(shape=name, capacity_factor=factor)
            for key in ("eager_ms", "graphed_layer_ms", "captured_step_ms"):
                if key in r:
                    r[key.replace("_ms", "_ratio")] = round(r[key] / r["floor_ms"], 3)
            print(json.dumps(r), flush=True)
            summary[f"{name}@{factor}"] = {key: r.get(key) for key in ("eager_ratio", "graphed_layer_ratio",
                                                                        "captured_step_ratio")}
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    sys.exit(main())
