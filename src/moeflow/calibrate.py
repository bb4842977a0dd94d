"""``moeflow calibrate``: micro-benchmarks -> alpha-beta fits -> a cluster profile (JSON).

Measured on the running job's ranks (spawned gloo workers, or ranks started by ``moeflow launch`` /
torchrun):

- the expert GEMM (m x M) @ (M x H) over token counts m, x = m*M*H;
- one whole expert FFN's forward and backward over the same m, x = m*M*H*2 (the cost model's
  ``t_ffn``: the GEMMs plus bias, activation and the weight-gradient GEMMs);
  both on every rank at once, the slowest rank's time: a layer's ranks compute together between
  its all-to-alls (on a shared CPU they contend for cores and memory) and wait for the slowest;
- each collective over message sizes: all-to-all per algorithm, all-reduce, all-gather,
  reduce-scatter, and the linear all-to-all inside the intra-node and the inter-node (same local
  rank) subgroups; x = bytes each rank contributes, time of the slowest rank;
- interference: a GEMM's slowdown while an asynchronous all-to-all is in flight;
- one whole call of a small MoE layer (``LAYER_PROBE``) over token counts, forward and backward,
  on every rank at once: what a layer call costs beyond its GEMMs and bytes (x = tokens per rank).

Every fit is made on half of the sizes and scored on the other half (held out): the profile stores
the fit, its R^2 and the median relative error of its predictions on the held-out sizes.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.algorithms import ALGORITHMS, all_to_all_with
from moeflow.comm.alltoall import all_to_all
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.saa import ep_esp_combine_allgather
from moeflow.comm.topology import Topology
from moeflow.distributed import destroy_process_groups
from moeflow.measure import interleaved_medians, slowest_rank_medians
from moeflow.perf import ClusterProfile, fit_alpha_beta, median_relative_error
from moeflow.perf.profile import LAYER_PROBE


@dataclass(frozen=True)
class CalibrationConfig:
    """What ``moeflow calibrate`` measures: the expert's dimensions, the token counts and message
    sizes it sweeps, and the repeats per point."""

    model_dim: int = 512
    hidden_dim: int = 1024
    gemm_tokens: tuple[int, ...] = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144)
    collective_bytes: tuple[int, ...] = tuple(int(2 ** (16 + i * 7 / 11)) for i in range(12))  # 64 KiB .. 8 MiB
    repeats: int = 5
    layer_repeats: int = 21  # a small layer's call is short and jittery: more samples, still about 2 s
    ranks_per_node: int | None = None  # the launcher's LOCAL_WORLD_SIZE; None: one node
    latency_emulated: str | None = None  # the testbed's MOEFLOW_TESTBED_LATENCY_EMULATED, recorded as is


def _gemm_points(config: CalibrationConfig) -> list[tuple[float, float]]:
    weight = torch.randn(config.model_dim, config.hidden_dim)
    inputs = {tokens: torch.randn(tokens, config.model_dim) for tokens in config.gemm_tokens}
    # round-robin over the sizes, like the collectives, so drift does not bend the curve
    medians = slowest_rank_medians(
        {tokens: (lambda x=x: torch.mm(x, weight)) for tokens, x in inputs.items()}, config.repeats
    )
    return [(tokens * config.model_dim * config.hidden_dim, seconds) for tokens, seconds in medians.items()]


def _ffn_points(config: CalibrationConfig) -> dict[str, list[tuple[float, float]]]:
    """One expert FFN (gelu, M x H) on m tokens, forward and backward timed whole: what the cost
    model's ``t_ffn`` prices (the GEMMs, bias, activation, input and weight gradients);
    x = m * M * H * 2 projections."""
    from moeflow.experts import ExpertFFN

    ffn = ExpertFFN(1, config.model_dim, config.hidden_dim)
    sizes = config.gemm_tokens[::2] if len(config.gemm_tokens) >= 8 else config.gemm_tokens  # >= 4 points
    inputs = {m: torch.randn(1, m, config.model_dim, requires_grad=True) for m in sizes}

    def forward_backward(x: torch.Tensor) -> None:
        ffn(x).sum().backward()

    work = {m: m * config.model_dim * config.hidden_dim * 2 for m in inputs}
    return _forward_backward_points("ffn", ffn, forward_backward, inputs, work, config.repeats)


def _layer_points(config: CalibrationConfig, world: int) -> dict[str, list[tuple[float, float]]]:
    """One call of :data:`LAYER_PROBE`'s layer (expert-parallel over the job, no pipelining, linear
    all-to-all) per token count, forward and backward; x = tokens per rank."""
    from moeflow.layer import MoELayer

    probe = LAYER_PROBE
    torch.manual_seed(0)
    layer = MoELayer(probe["model_dim"], probe["hidden_dim"], probe["experts_per_rank"] * world,
                     top_k=probe["top_k"], capacity_factor=1.0, pipeline=1, alltoall="linear", parallel="expert",
                     group=ParallelGroups(dist.group.WORLD, _topology(config, world)))
    inputs = {tokens: torch.randn(tokens, probe["model_dim"], requires_grad=True) for tokens in probe["tokens"]}

    def forward_backward(x: torch.Tensor) -> None:
        (layer(x).square().mean() + layer.aux_loss).backward()
        layer.zero_grad(set_to_none=True)

    return _forward_backward_points("layer", layer, forward_backward, inputs, {t: t for t in inputs},
                                    config.layer_repeats)


def _forward_backward_points(
    name: str, forward: Callable[[torch.Tensor], object], forward_backward: Callable[[torch.Tensor], object],
    inputs: dict[int, torch.Tensor], work: dict[int, float], repeats: int,
) -> dict[str, list[tuple[float, float]]]:
    """``<name>.forward`` and ``<name>.backward`` points (x = ``work`` of each input), round-robin on
    every rank at once, slowest rank; the backward is (forward + backward) - forward, medians."""
    operations = {("forward", k): (lambda x=x: forward(x)) for k, x in inputs.items()}
    operations |= {("both", k): (lambda x=x: forward_backward(x)) for k, x in inputs.items()}
    medians = slowest_rank_medians(operations, repeats)
    return {
        f"{name}.forward": [(work[k], medians[("forward", k)]) for k in inputs],
        f"{name}.backward": [(work[k], max(0.0, medians[("both", k)] - medians[("forward", k)])) for k in inputs],
    }


def _topology(config: CalibrationConfig, world: int) -> Topology:
    return Topology(world, config.ranks_per_node or world)


def _collective_points(config: CalibrationConfig, world: int) -> dict[str, list[tuple[float, float]]]:
    topology = _topology(config, world)
    parallel = ParallelGroups(dist.group.WORLD, topology)
    points: dict[str, list[tuple[float, float]]] = {}
    operations_by_size: list[tuple[int, dict[str, Callable[[], object]]]] = []
    for size in config.collective_bytes:
        elements = max(world, size // 4 // world * world)
        x = torch.zeros(elements)
        operations: dict[str, Callable[[], object]] = {
            f"alltoall.{name}": (lambda name=name, x=x: all_to_all_with(name, x, parallel)) for name in ALGORITHMS
        }
        operations["allreduce"] = lambda x=x: dist.all_reduce(x.clone(), group=dist.group.WORLD)
        gathered = [torch.empty_like(x) for _ in range(world)]
        operations["allgather"] = lambda x=x, gathered=gathered: dist.all_gather(gathered, x)
        scattered = torch.empty(elements // world)
        operations["reducescatter"] = lambda x=x, out=scattered: dist.reduce_scatter_single(out, x)
        # the same linear all-to-all inside each kind of subgroup: the fast and the slow link
        if topology.ranks_per_node > 1:
            operations |= _intra_node_operations(x, parallel, topology.ranks_per_node)
        if topology.num_nodes > 1:
            operations["alltoall.inter_node"] = lambda x=x: all_to_all(x, parallel.node_groups().inter_node)
        operations_by_size.append((elements * 4, operations))
    # round-robin over every (operation, size), so that slow drift of the machine spreads over all
    # points instead of bending the curve; the median per point is kept (the warm-up round opens
    # connections and buffers for every size)
    measurements = {(name, size): operation for size, operations in operations_by_size
                    for name, operation in operations.items()}
    for (name, size_bytes), seconds in slowest_rank_medians(measurements, config.repeats).items():
        points.setdefault(name, []).append((size_bytes, seconds))
    return points


def _intra_node_operations(
    x: torch.Tensor, parallel: ParallelGroups, ranks_per_node: int
) -> dict[str, Callable[[], object]]:
    """What runs inside a node: the linear all-to-all (the fast link), the all-gather over a
    tensor-parallel (MP) group, and Parm's SAA (the S2 combine: fused EP&ESP all-to-all of x
    overlapped with the MP all-gather, N_MP = N_ESP = ranks per node); x is the bytes in."""
    intra = parallel.node_groups().intra_node
    gathered = x.new_empty(ranks_per_node * x.numel())
    partial = x.view(1, -1, 1)
    capacity = partial.shape[1] // parallel.size
    return {
        "alltoall.intra_node": lambda: all_to_all(x, intra),
        "allgather.intra_node": lambda: dist.all_gather_single(gathered, x, group=intra),
        "alltoall.saa": lambda: ep_esp_combine_allgather(partial, ranks_per_node, capacity, parallel.expert, intra),
    }


def _interference(config: CalibrationConfig, world: int) -> float:
    """GEMM time while an all-to-all is in flight over GEMM time alone (>= 1 means slowdown)."""
    x = torch.randn(config.gemm_tokens[-1], config.model_dim)
    weight = torch.randn(config.model_dim, config.hidden_dim)
    payload = torch.zeros(world * (config.collective_bytes[-1] // 4 // world))
    received = torch.empty_like(payload)

    def gemm_during_alltoall() -> None:
        work = dist.all_to_all_single(received, payload, async_op=True)
        start = time.perf_counter()
        torch.mm(x, weight)
        samples.append(time.perf_counter() - start)
        work.wait()

    alone = interleaved_medians({"gemm": lambda: torch.mm(x, weight)}, config.repeats)["gemm"]
    samples: list[float] = []
    for _ in range(config.repeats + 1):
        dist.barrier()
        gemm_during_alltoall()
    return max(1.0, statistics.median(samples[1:]) / alone)


def _fit_with_holdout(name: str, points: list[tuple[float, float]], unit: str) -> tuple[Any, dict[str, Any]]:
    train, held_out = points[0::2], points[1::2]
    fit = fit_alpha_beta([p[0] for p in train], [p[1] for p in train], unit)
    error = median_relative_error(fit, [p[0] for p in held_out], [p[1] for p in held_out])
    return fit, {"fit": name, "alpha_s": fit.alpha, "beta_s_per_unit": fit.beta, "unit": unit, "r2": fit.r2,
                 "heldout_median_rel_error": error, "points": len(points)}


def calibrate_rank(rank: int, world: int, config: CalibrationConfig) -> dict[str, Any] | None:
    """Run on every rank of an initialized process group; rank 0 returns the profile as a dict."""
    torch.set_num_threads(1)
    topology = _topology(config, world)
    gemm = _gemm_points(config)
    ffn = _ffn_points(config)
    collectives = _collective_points(config, world) if world > 1 else {}
    interference = _interference(config, world) if world > 1 else 1.0
    layer = _layer_points(config, world)
    if rank != 0:
        return None
    fits, quality = {}, []
    fits["gemm"], report = _fit_with_holdout("gemm", gemm, "m*k*n")
    quality.append(report)
    for name, points in ffn.items():
        fits[name], report = _fit_with_holdout(name, points, "m*M*H*projections")
        quality.append(report)
    for name, points in collectives.items():
        fits[name], report = _fit_with_holdout(name, points, "bytes")
        quality.append(report)
    for name, points in layer.items():
        fits[name], report = _fit_with_holdout(name, points, "tokens")
        quality.append(report)
    profile = ClusterProfile(
        nodes=topology.num_nodes, ranks_per_node=topology.ranks_per_node, fits=fits, interference=interference,
        machine={
            "platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads_per_rank": 1, "backend": dist.get_backend(),
            "latency_emulated": config.latency_emulated,
        },
        quality={"fits": quality, "interference": interference},
    )
    return profile.to_dict()


def calibrate_from_env(config: CalibrationConfig) -> dict[str, Any] | None:
    """Entry point for ranks started by ``moeflow launch`` or torchrun (env:// rendezvous)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        return calibrate_rank(dist.get_rank(), dist.get_world_size(), config)
    finally:
        destroy_process_groups()
