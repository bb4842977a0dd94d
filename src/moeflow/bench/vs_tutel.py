"""moeflow's MoELayer against Tutel's (its CPU build) or DeepSpeed-MoE's on the same weights and tokens.

    PYTHONPATH=<tutel> python -m moeflow.bench.vs_tutel                  # one process
    PYTHONPATH=<tutel> python -m moeflow.bench.vs_tutel --workers 2      # two gloo processes, loopback
    moeflow launch --nodes 2 --ranks-per-node 1 --inter-gbit 1 -- python -m moeflow.bench.vs_tutel
    DS_ACCELERATOR=cpu PYTHONPATH=<deepspeed> python -m moeflow.bench.vs_tutel --against deepspeed --workers 2

Dropless (capacity factor 0), top-2, gelu experts with biases, fp32, one intra-op thread per rank,
forward+backward of sum(y * upstream). moeflow runs its defaults (the planner picks the pipeline
degree and the all-to-all; its online trials settle during the warm-up); Tutel runs its defaults
(overlap degree 1); DeepSpeed-MoE (``deepspeed.moe.layer.MoE``, its sparse routes) runs dropless
(``drop_tokens=False``) with the deterministic top-2 (no random token selection, no sampled second
expert), its experts one ``nn.Module`` each. The two run round-robin; each timing is the slowest
rank's, medians. The first line per shape checks that both compute the same function (max abs
difference of the outputs). Neither is a dependency of moeflow: build Tutel from its sources
(NO_CUDA=1 pip install --target), install DeepSpeed with DS_BUILD_OPS=0 and run it with
DS_ACCELERATOR=cpu.
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


def _layers(
    shape: tuple[int, int, int, int], rank: int, world: int, pipeline: int | str, against: str = "tutel",
    kernel: dict[str, str] | None = None,
) -> tuple[Any, Any]:
    from moeflow import MoELayer

    _, model_dim, hidden_dim, local = shape
    num_experts = local * world
    full = _full_weights(num_experts, model_dim, hidden_dim)
    ours = MoELayer(model_dim, hidden_dim, num_experts, top_k=2, capacity_factor=0.0, activation="gelu",
                    aux_loss_weight=0.0, pipeline=pipeline, **_groups(world), **(kernel or {}))
    if hasattr(ours, "load_full_state_dict"):
        ours.load_full_state_dict({**ours.state_dict(), **full})
    else:  # moeflow before the placement seam (for side-by-side runs of older commits)
        from moeflow.core.experts import shard_expert_state

        ours.load_state_dict(shard_expert_state({**ours.state_dict(), **full}, rank, world))
    mine = slice(rank * local, (rank + 1) * local)
    build = _deepspeed_layer if against == "deepspeed" else _tutel_layer
    return ours, build(full, mine, model_dim, hidden_dim, world)


def _tutel_layer(full: dict[str, torch.Tensor], mine: slice, model_dim: int, hidden_dim: int, world: int) -> Any:
    import torch.distributed as dist
    from tutel import moe as tutel_moe

    local = mine.stop - mine.start
    group = dist.group.WORLD if dist.is_initialized() else None
    tutel = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": 2, "capacity_factor": 0.0, "fp32_gate": True}, model_dim=model_dim,
        experts={"type": "ffn", "count_per_node": local, "hidden_size_per_expert": hidden_dim,
                 "activation_fn": lambda x: F.gelu(x)},
        group=group,
    )
    with torch.no_grad():
        tutel.gates[0].wg.weight.copy_(full["gate.weight"])
        tutel.experts.batched_fc1_w.copy_(full["experts.w1"][mine].transpose(1, 2))
        tutel.experts.batched_fc1_bias.copy_(full["experts.b1"][mine])
        tutel.experts.batched_fc2_w.copy_(full["experts.w2"][mine])
        tutel.experts.batched_fc2_bias.copy_(full["experts.b2"][mine])
    return tutel


class _GeluFFN(torch.nn.Module):
    """One DeepSpeed expert: fc2(gelu(fc1(x))), with biases."""

    def __init__(self, model_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(model_dim, hidden_dim), torch.nn.Linear(hidden_dim, model_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _OutputOnly(torch.nn.Module):
    """DeepSpeed's MoE returns (output, l_aux, counts); the benchmark's step takes the output."""

    def __init__(self, moe: torch.nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _deepspeed_layer(full: dict[str, torch.Tensor], mine: slice, model_dim: int, hidden_dim: int, world: int) -> Any:
    import deepspeed.comm as ds_comm
    from deepspeed.moe.layer import MoE

    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # wraps the initialised group
    num_experts = full["gate.weight"].shape[0]
    moe = MoE(model_dim, _GeluFFN(model_dim, hidden_dim), num_experts, ep_size=world, k=2, capacity_factor=1.0,
              drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(full["gate.weight"])
        experts = moe.deepspeed_moe.experts.deepspeed_experts
        for expert, index in zip(experts, range(mine.start, mine.stop), strict=True):
            expert.fc1.weight.copy_(full["experts.w1"][index].T)
            expert.fc1.bias.copy_(full["experts.b1"][index])
            expert.fc2.weight.copy_(full["experts.w2"][index].T)
            expert.fc2.bias.copy_(full["experts.b2"][index])
    return _OutputOnly(moe)


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
        from moeflow.timing.measure import slowest_rank_seconds

        return slowest_rank_seconds(fn)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(
    rank: int, world: int, shapes: list[tuple[int, int, int, int]], repeats: int, pipeline: int | str = "auto",
    against: str = "tutel", expert_kernel: str | None = None, token_exchange: str | None = None,
) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    records = []
    kernel = {} if expert_kernel is None else {"expert_kernel": expert_kernel}  # None: moeflow's default
    if token_exchange is not None:
        kernel["token_exchange"] = token_exchange
    for shape in shapes:
        ours, tutel = _layers(shape, rank, world, pipeline, against, kernel)
        generator = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(shape[0], shape[1], generator=generator)
        upstream = torch.randn(shape[0], shape[1], generator=generator)
        difference = float((_step(ours, x, upstream) - _step(tutel, x, upstream)).abs().max())
        for _ in range(16):  # warm-up; moeflow's planner settles its online trials here
            _step(ours, x, upstream)
            _step(tutel, x, upstream)
        samples: dict[str, list[float]] = {"moeflow": [], "tutel": []}  # "tutel": the baseline
        for _ in range(repeats):
            for name, layer in (("moeflow", ours), ("tutel", tutel)):
                samples[name].append(_slowest(lambda layer=layer, x=x, upstream=upstream: _step(layer, x, upstream)))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        plan = ours.last_stats.plan if ours.last_stats is not None else None
        if isinstance(plan, dict):  # older commits kept the plan as a dict
            plan = argparse.Namespace(**plan)
        records.append({
            "bench": "vs_tutel", "against": against, "tokens": shape[0], "model_dim": shape[1], "hidden_dim": shape[2],
            "experts_per_rank": shape[3], "ranks": world, "max_abs_difference": difference,
            "moeflow_ms": medians["moeflow"] * 1e3, f"{against}_ms": medians["tutel"] * 1e3,
            "speedup": medians["tutel"] / medians["moeflow"],
            "moeflow_plan": f"d{plan.pipeline_degree}-{plan.alltoall}" if plan else None,
            "moeflow_kernel": getattr(plan, "expert_kernel", None),
            "token_exchange": getattr(plan, "token_exchange", None),
        })
    return records


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    speedups = [r["speedup"] for r in records]
    geomean = statistics.geometric_mean(speedups)
    return {"summary": "vs_tutel", "against": records[0]["against"], "ranks": records[0]["ranks"],
            "geomean_speedup": geomean,
            "worst_speedup": min(speedups), "max_abs_difference": max(r["max_abs_difference"] for r in records)}


def _shape(text: str, parser: argparse.ArgumentParser) -> tuple[int, int, int, int]:
    values = text.split(",")
    if len(values) != 4 or not all(value.isdigit() and int(value) > 0 for value in values):
        parser.error(f"--shapes {text!r}: give T,M,H,L as four positive integers, e.g. 2048,256,256,16")
    return int(values[0]), int(values[1]), int(values[2]), int(values[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="gloo processes to spawn when not launched")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per layer (medians)")
    parser.add_argument("--pipeline", default="auto", help="moeflow's pipeline setting: auto (default) or a degree")
    parser.add_argument("--expert-kernel", default=None, help="moeflow's expert_kernel (default: its default)")
    parser.add_argument("--token-exchange", default=None, help="moeflow's token_exchange (default: its default)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="T,M,H,L",
                        help="the shapes to run: tokens per rank, model dim, hidden dim, experts per rank "
                        "(default: the four of SHAPES)")
    parser.add_argument("--against", choices=("tutel", "deepspeed"), default="tutel",
                        help="the other MoE layer: Tutel's (default) or DeepSpeed-MoE's")
    args = parser.parse_args()
    pipeline = int(args.pipeline) if args.pipeline.isdigit() else args.pipeline
    shapes = list(SHAPES) if args.shapes is None else [_shape(text, parser) for text in args.shapes]
    if "RANK" in os.environ:  # a rank of moeflow launch or torchrun
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        records = measure(dist.get_rank(), dist.get_world_size(), shapes, args.repeats, pipeline, args.against,
                          args.expert_kernel, args.token_exchange)
        rank = dist.get_rank()
        dist.destroy_process_group()
    elif args.workers > 1 or args.against == "deepspeed":  # DeepSpeed's gate all-reduces even on one rank
        from moeflow.distributed import run_distributed

        records, rank = run_distributed(measure, args.workers, shapes, args.repeats, pipeline, args.against,
                                        args.expert_kernel, args.token_exchange, timeout_s=3600)[0], 0
    else:
        records, rank = measure(0, 1, shapes, args.repeats, pipeline, args.against, args.expert_kernel,
                                 args.token_exchange), 0
    if rank == 0:
        for record in records:
            print(json.dumps(record), flush=True)
        print(json.dumps(_summary(records)), flush=True)


if __name__ == "__main__":
    main()
