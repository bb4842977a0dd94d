"""moeflow's MoELayer against Tutel's (its CPU build) on the same weights and tokens.

    PYTHONPATH=<tutel> python -m moeflow.bench.vs_tutel                  # one process
    PYTHONPATH=<tutel> python -m moeflow.bench.vs_tutel --workers 2      # two gloo processes, loopback
    moeflow launch --nodes 2 --ranks-per-node 1 --inter-gbit 1 -- python -m moeflow.bench.vs_tutel

Dropless (capacity factor 0), top-2, gelu experts with biases, fp32, one intra-op thread per rank,
forward+backward of sum(y * upstream). moeflow runs its defaults (the planner picks the pipeline
degree and the all-to-all; its online trials settle during the warm-up); Tutel runs its defaults
(overlap degree 1). The two run round-robin; each timing is the slowest rank's, medians. The first
line per shape checks that both compute the same function (max abs difference of the outputs).
Tutel is not a dependency of moeflow: build it from its sources (NO_CUDA=1 pip install --target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = ((4096, 512, 2048, 2), (4096, 512, 512, 4), (2048, 1024, 1024, 2), (1024, 256, 1024, 2))
"""(tokens per rank T, model dim M, hidden H, experts per rank L)."""


def _full_weights(num_experts: int, model_dim: int, hidden_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    return {
        "gate.weight": draw(num_experts, model_dim, scale=model_dim**-0.5),
        "experts.w1": draw(num_experts, model_dim, hidden_dim, scale=model_dim**-0.5),
        "experts.b1": draw(num_experts, hidden_dim, scale=0.1),
        "experts.w2": draw(num_experts, hidden_dim, model_dim, scale=hidden_dim**-0.5),
        "experts.b2": draw(num_experts, model_dim, scale=0.1),
    }


def _layers(shape: tuple[int, int, int, int], rank: int, world: int, pipeline: int | str) -> tuple[Any, Any]:
    import torch.distributed as dist
    from tutel import moe as tutel_moe

    from moeflow import MoELayer

    _, model_dim, hidden_dim, local = shape
    num_experts = local * world
    full = _full_weights(num_experts, model_dim, hidden_dim)
    ours = MoELayer(model_dim, hidden_dim, num_experts, top_k=2, capacity_factor=0.0, activation="gelu",
                    aux_loss_weight=0.0, pipeline=pipeline, **_groups(world))
    if hasattr(ours, "load_full_state_dict"):
        ours.load_full_state_dict({**ours.state_dict(), **full})
    else:  # moeflow before the placement seam (for side-by-side runs of older commits)
        from moeflow.experts import shard_expert_state

        ours.load_state_dict(shard_expert_state({**ours.state_dict(), **full}, rank, world))
    group = dist.group.WORLD if dist.is_initialized() else None
    tutel = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": 2, "capacity_factor": 0.0, "fp32_gate": True}, model_dim=model_dim,
        experts={"type": "ffn", "count_per_node": local, "hidden_size_per_expert": hidden_dim,
                 "activation_fn": lambda x: F.gelu(x)},
        group=group,
    )
    mine = slice(rank * local, (rank + 1) * local)
    with torch.no_grad():
        tutel.gates[0].wg.weight.copy_(full["gate.weight"])
        tutel.experts.batched_fc1_w.copy_(full["experts.w1"][mine].transpose(1, 2))
        tutel.experts.batched_fc1_bias.copy_(full["experts.b1"][mine])
        tutel.experts.batched_fc2_w.copy_(full["experts.w2"][mine])
        tutel.experts.batched_fc2_bias.copy_(full["experts.b2"][mine])
    return ours, tutel


def _groups(world: int) -> dict[str, Any]:
    """The launcher's topology (LOCAL_WORLD_SIZE), passed in as a user's script does; older commits
    read it from the environment themselves."""
    import torch.distributed as dist

    try:
        from moeflow.comm.groups import ParallelGroups
        from moeflow.comm.topology import topology_from_environment
    except ImportError:
        return {}
    if not dist.is_initialized():
        return {}
    return {"group": ParallelGroups(dist.group.WORLD, topology_from_environment(os.environ, world))}


def _step(layer: Any, x: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    y = layer(x.unsqueeze(0)).squeeze(0)
    (y * upstream).sum().backward()
    layer.zero_grad(set_to_none=True)
    return y.detach()


def _slowest(fn: Any) -> float:
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        from moeflow.measure import slowest_rank_seconds

        return slowest_rank_seconds(fn)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(
    rank: int, world: int, shapes: list[tuple[int, int, int, int]], repeats: int, pipeline: int | str = "auto"
) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    records = []
    for shape in shapes:
        ours, tutel = _layers(shape, rank, world, pipeline)
        generator = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(shape[0], shape[1], generator=generator)
        upstream = torch.randn(shape[0], shape[1], generator=generator)
        difference = float((_step(ours, x, upstream) - _step(tutel, x, upstream)).abs().max())
        for _ in range(16):  # warm-up; moeflow's planner settles its online trials here
            _step(ours, x, upstream)
            _step(tutel, x, upstream)
        samples: dict[str, list[float]] = {"moeflow": [], "tutel": []}
        for _ in range(repeats):
            for name, layer in (("moeflow", ours), ("tutel", tutel)):
                samples[name].append(_slowest(lambda layer=layer, x=x, upstream=upstream: _step(layer, x, upstream)))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        plan = ours.last_stats.plan if ours.last_stats is not None else None
        if isinstance(plan, dict):  # older commits kept the plan as a dict
            plan = argparse.Namespace(**plan)
        records.append({
            "bench": "vs_tutel", "tokens": shape[0], "model_dim": shape[1], "hidden_dim": shape[2],
            "experts_per_rank": shape[3], "ranks": world, "max_abs_difference": difference,
            "moeflow_ms": medians["moeflow"] * 1e3, "tutel_ms": medians["tutel"] * 1e3,
            "speedup": medians["tutel"] / medians["moeflow"],
            "moeflow_plan": f"d{plan.pipeline_degree}-{plan.alltoall}" if plan else None,
        })
    return records


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    speedups = [r["speedup"] for r in records]
    geomean = statistics.geometric_mean(speedups)
    return {"summary": "vs_tutel", "ranks": records[0]["ranks"], "geomean_speedup": geomean,
            "worst_speedup": min(speedups), "max_abs_difference": max(r["max_abs_difference"] for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="gloo processes to spawn when not launched")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per layer (medians)")
    parser.add_argument("--pipeline", default="auto", help="moeflow's pipeline setting: auto (default) or a degree")
    args = parser.parse_args()
    pipeline = int(args.pipeline) if args.pipeline.isdigit() else args.pipeline
    if "RANK" in os.environ:  # a rank of moeflow launch or torchrun
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        records = measure(dist.get_rank(), dist.get_world_size(), list(SHAPES), args.repeats, pipeline)
        rank = dist.get_rank()
        dist.destroy_process_group()
    elif args.workers > 1:
        from moeflow.distributed import run_distributed

        records, rank = run_distributed(measure, args.workers, list(SHAPES), args.repeats, pipeline,
                                           timeout_s=3600)[0], 0
    else:
        records, rank = measure(0, 1, list(SHAPES), args.repeats, pipeline), 0
    if rank == 0:
        for record in records:
            print(json.dumps(record), flush=True)
        print(json.dumps(_summary(records)), flush=True)


if __name__ == "__main__":
    main()
