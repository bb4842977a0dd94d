"""``moeflow calibrate``: micro-benchmarks -> alpha-beta fits -> a cluster profile (JSON).

Measured on the running job's ranks (spawned gloo workers, or ranks started by ``moeflow launch`` /
torchrun), on ``CalibrationConfig.device``: the CPU, or a rank's GPU (``cuda``), where the compute
fits run on the device in ``CalibrationConfig.dtype``, timed with CUDA events, and the collectives
run over NCCL when the job has more than one GPU (one GPU: no collective is measured and the
profile says so, :data:`~moeflow.perf.profile.NOT_MEASURED`):

- the expert GEMM (m x M) @ (M x H) over token counts m, x = m*M*H;
- one whole expert FFN's forward and backward over the same m, x = m*M*H*2 (the cost model's
  ``t_ffn``: the GEMMs plus bias, activation and the weight-gradient GEMMs);
- encode and decode forward (the kernels ``kernel_backend="auto"`` picks on the device) over the
  same token counts routed top-k over a few experts, x = bytes of the routed rows;
  all on every rank at once, the slowest rank's time: a layer's ranks compute together between
  its all-to-alls (on a shared CPU they contend for cores and memory) and wait for the slowest;
- each collective over message sizes: all-to-all per algorithm, all-reduce, all-gather,
  reduce-scatter, and the linear all-to-all inside the intra-node and the inter-node (same local
  rank) subgroups; x = bytes each rank contributes, time of the slowest rank;
- interference: a GEMM's slowdown while an asynchronous all-to-all is in flight;
- one whole call of a small MoE layer (``LAYER_PROBE``) over token counts, forward and backward,
  on every rank at once: what a layer call costs beyond its GEMMs and bytes (x = tokens per rank);
- forward and backward of a larger layer (``PIPELINE_PROBE``) at pipeline degrees 1, 2, 4 and 8:
  what chunking costs or gains on the machine (x = the degree).

Every fit is made on half of the sizes and scored on the other half (held out): the profile stores
the fit, its R^2 and the median relative error of its predictions on the held-out sizes.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.algorithms import ALGORITHMS, all_to_all_with
from moeflow.comm.alltoall import all_to_all
from moeflow.comm.clock import start_span
from moeflow.comm.collectives import (
    all_gather,
    all_gather_into,
    all_reduce,
    all_to_all_single,
    barrier,
    reduce_scatter_into,
)
from moeflow.comm.groups import ParallelGroups
from moeflow.comm.saa import ep_esp_combine_allgather
from moeflow.comm.topology import Topology
from moeflow.config import DTYPE_NAMES
from moeflow.distributed import destroy_process_groups, free_port
from moeflow.kernels.choice import KernelTable, device_name
from moeflow.kernels.precision import DTYPES
from moeflow.perf import ClusterProfile, ProfileDevice, fit_alpha_beta, median_relative_error
from moeflow.perf.profile import LAYER_PROBE, NOT_MEASURED, PIPELINE_PROBE
from moeflow.timing.measure import device_medians, slowest_rank_medians

DEVICES = ("cpu", "cuda")
"""What ``moeflow calibrate --device`` measures on: the CPU, or each rank's GPU."""


DEVICE_DIMS = {"cpu": (512, 1024), "cuda": (4096, 8192)}
"""The default (model, hidden) dimensions of the GEMMs timed on each device: on an H200 a 512 x 1024
GEMM of up to 6144 tokens takes microseconds, launch-bound, and the fits came out flat (a negative
slope at 256 x 512, 2026-11-27); 4096 x 8192 puts every point in the compute-bound range."""


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
    device: str = "cpu"  # cpu, cuda or cuda:N (a launched rank's own GPU): where every fit runs
    dtype: str = "fp32"  # of the compute fits (GEMM, encode/decode, FFN, layer probe); collectives move bytes
    dispatch_experts: int = 8  # the encode/decode fits route each token to top_k of this many experts
    dispatch_top_k: int = 2

    def __post_init__(self) -> None:
        if torch.device(self.device).type not in DEVICES:
            raise ValueError(f"device={self.device!r}; calibrate measures on {' or '.join(DEVICES)}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")

    @property
    def torch_device(self) -> torch.device:
        """The device the fits run on, with its index on CUDA (the current device if none)."""
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _gemm_points(config: CalibrationConfig) -> list[tuple[float, float]]:
    device, dtype = config.torch_device, config.torch_dtype
    weight = torch.randn(config.model_dim, config.hidden_dim, device=device, dtype=dtype)
    inputs = {tokens: torch.randn(tokens, config.model_dim, device=device, dtype=dtype)
              for tokens in config.gemm_tokens}
    # round-robin over the sizes, like the collectives, so drift does not bend the curve
    medians = slowest_rank_medians(
        {tokens: (lambda x=x: torch.mm(x, weight)) for tokens, x in inputs.items()}, config.repeats, device=device
    )
    return [(tokens * config.model_dim * config.hidden_dim, seconds) for tokens, seconds in medians.items()]


def _sizes(config: CalibrationConfig) -> tuple[int, ...]:
    """Every other GEMM token count where there are 8 or more: >= 4 points for the FFN and dispatch fits."""
    return config.gemm_tokens[::2] if len(config.gemm_tokens) >= 8 else config.gemm_tokens


def _ffn_points(config: CalibrationConfig) -> dict[str, list[tuple[float, float]]]:
    """One expert FFN (gelu, M x H) on m tokens, forward and backward timed whole: what the cost
    model's ``t_ffn`` prices (the GEMMs, bias, activation, input and weight gradients);
    x = m * M * H * 2 projections."""
    from moeflow.core.experts import ExpertFFN

    device, dtype = config.torch_device, config.torch_dtype
    ffn = ExpertFFN(1, config.model_dim, config.hidden_dim).to(device=device, dtype=dtype)
    inputs = {m: torch.randn(1, m, config.model_dim, device=device, dtype=dtype, requires_grad=True)
              for m in _sizes(config)}

    def forward_backward(x: torch.Tensor) -> None:
        ffn(x).sum().backward()

    work = {m: m * config.model_dim * config.hidden_dim * 2 for m in inputs}
    return _forward_backward_points("ffn", ffn, forward_backward, inputs, work, config.repeats, device)


def _dispatch_points(config: CalibrationConfig, kernels: KernelTable) -> dict[str, list[tuple[float, float]]]:
    """Encode (tokens into the (E, C, M) buffer) and decode (weighted back to tokens) forward, with
    the kernels ``kernel_backend="auto"`` picks on this device and dtype, over m tokens routed
    uniformly at random to ``dispatch_top_k`` of ``dispatch_experts`` (capacity factor 1);
    x = m * k * M * element bytes, the routed rows."""
    from moeflow.core.routing import assign_slots, expert_capacity
    from moeflow.kernels.slot_gather import decode, encode, make_slot_map

    device, dtype = config.torch_device, config.torch_dtype
    experts, top_k = config.dispatch_experts, config.dispatch_top_k
    choice = kernels.resolve("auto", device, dtype)
    generator = torch.Generator().manual_seed(0)
    operations: dict[tuple[str, int], Callable[[], object]] = {}
    work: dict[int, float] = {}
    for m in _sizes(config):
        expert_idx_TK = torch.rand(m, experts, generator=generator).topk(top_k, dim=1).indices
        location_TK, counts_E = assign_slots(expert_idx_TK, experts)
        capacity = expert_capacity(1.0, top_k, m, experts, int(counts_E.max()))
        plan = make_slot_map(expert_idx_TK.to(device), location_TK.to(device), experts, capacity)
        x_TM = torch.randn(m, config.model_dim, generator=generator).to(device, dtype)
        weights_TK = torch.rand(m, top_k, generator=generator).to(device, dtype)
        buffer = encode(x_TM, plan, backend=choice.encode)
        operations[("encode", m)] = lambda x=x_TM, plan=plan: encode(x, plan, backend=choice.encode)
        operations[("decode", m)] = lambda b=buffer, w=weights_TK, plan=plan: decode(b, w, plan, backend=choice.decode)
        work[m] = m * top_k * config.model_dim * x_TM.element_size()
    with torch.no_grad():
        medians = slowest_rank_medians(operations, config.repeats, device=device)
    return {kernel: [(work[m], medians[(kernel, m)]) for m in work] for kernel in ("encode", "decode")}


def _layer_points(config: CalibrationConfig, world: int, kernels: KernelTable) -> dict[str, list[tuple[float, float]]]:
    """One call of :data:`LAYER_PROBE`'s layer (expert-parallel over the job, no pipelining, linear
    all-to-all) per token count, forward and backward; x = tokens per rank. On a GPU the layer's
    parameters stay fp32 and its input is ``dtype`` (the layer's mixed precision)."""
    from moeflow.moe.layer import MoELayer

    probe = LAYER_PROBE
    device, dtype = config.torch_device, config.torch_dtype
    torch.manual_seed(0)
    layer = MoELayer(probe["model_dim"], probe["hidden_dim"], probe["experts_per_rank"] * world,
                     top_k=probe["top_k"], capacity_factor=1.0, pipeline=1, alltoall="linear", parallel="expert",
                     group=ParallelGroups(dist.group.WORLD, _topology(config, world))).to(device)
    layer.kernel_table = kernels  # measured once for the dispatch fits and the layer
    inputs = {tokens: torch.randn(tokens, probe["model_dim"], device=device, dtype=dtype, requires_grad=True)
              for tokens in probe["tokens"]}

    def forward_backward(x: torch.Tensor) -> None:
        (layer(x).float().square().mean() + layer.aux_loss).backward()
        layer.zero_grad(set_to_none=True)

    return _forward_backward_points("layer", layer, forward_backward, inputs, {t: t for t in inputs},
                                    config.layer_repeats, device)


def _pipeline_points(
    config: CalibrationConfig, world: int, kernels: KernelTable
) -> dict[str, list[tuple[float, float]]]:
    """:data:`PIPELINE_PROBE`'s layer, forward and backward, at each of its pipeline degrees (linear
    all-to-all), round-robin on every rank at once, slowest rank; x = the degree."""
    from moeflow.moe.layer import MoELayer

    probe = PIPELINE_PROBE
    device, dtype = config.torch_device, config.torch_dtype
    groups = ParallelGroups(dist.group.WORLD, _topology(config, world))
    x = torch.randn(probe["tokens"], probe["model_dim"], device=device, dtype=dtype, requires_grad=True)
    layers = {}
    for degree in probe["degrees"]:
        torch.manual_seed(0)
        layers[degree] = MoELayer(probe["model_dim"], probe["hidden_dim"], probe["experts_per_rank"] * world,
                                  top_k=probe["top_k"], capacity_factor=1.0, pipeline=degree, alltoall="linear",
                                  parallel="expert", group=groups).to(device)
        layers[degree].kernel_table = kernels

    def forward_backward(layer: MoELayer) -> None:
        (layer(x).float().square().mean() + layer.aux_loss).backward()
        layer.zero_grad(set_to_none=True)

    operations = {degree: (lambda layer=layer: forward_backward(layer)) for degree, layer in layers.items()}
    medians = slowest_rank_medians(operations, config.repeats, device=device)
    return {"layer.pipelined": [(float(degree), medians[degree]) for degree in probe["degrees"]]}


def _forward_backward_points(
    name: str, forward: Callable[[torch.Tensor], object], forward_backward: Callable[[torch.Tensor], object],
    inputs: dict[int, torch.Tensor], work: dict[int, float], repeats: int, device: torch.device,
) -> dict[str, list[tuple[float, float]]]:
    """``<name>.forward`` and ``<name>.backward`` points (x = ``work`` of each input), round-robin on
    every rank at once, slowest rank; the backward is (forward + backward) - forward, medians."""
    operations = {("forward", k): (lambda x=x: forward(x)) for k, x in inputs.items()}
    operations |= {("both", k): (lambda x=x: forward_backward(x)) for k, x in inputs.items()}
    medians = slowest_rank_medians(operations, repeats, device=device)
    return {
        f"{name}.forward": [(work[k], medians[("forward", k)]) for k in inputs],
        f"{name}.backward": [(work[k], max(0.0, medians[("both", k)] - medians[("forward", k)])) for k in inputs],
    }


def _topology(config: CalibrationConfig, world: int) -> Topology:
    return Topology(world, config.ranks_per_node or world)


def _collective_points(config: CalibrationConfig, world: int) -> dict[str, list[tuple[float, float]]]:
    """fp32 tensors on the device (over NCCL on GPUs, gloo on CPUs); x = bytes each rank contributes."""
    topology = _topology(config, world)
    parallel = ParallelGroups(dist.group.WORLD, topology)
    device = config.torch_device
    points: dict[str, list[tuple[float, float]]] = {}
    operations_by_size: list[tuple[int, dict[str, Callable[[], object]]]] = []
    for size in config.collective_bytes:
        elements = max(world, size // 4 // world * world)
        x = torch.zeros(elements, device=device)
        operations: dict[str, Callable[[], object]] = {
            f"alltoall.{name}": (lambda name=name, x=x: all_to_all_with(name, x, parallel)) for name in ALGORITHMS
        }
        operations["allreduce"] = lambda x=x: all_reduce(x.clone(), dist.group.WORLD)
        gathered = [torch.empty_like(x) for _ in range(world)]
        operations["allgather"] = lambda x=x, gathered=gathered: all_gather(gathered, x, None)
        scattered = torch.empty(elements // world, device=device)
        operations["reducescatter"] = lambda x=x, out=scattered: reduce_scatter_into(out, x, None)
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
    for (name, size_bytes), seconds in slowest_rank_medians(measurements, config.repeats, device=device).items():
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
        "allgather.intra_node": lambda: all_gather_into(gathered, x, intra),
        "alltoall.saa": lambda: ep_esp_combine_allgather(partial, ranks_per_node, capacity, parallel.expert, intra),
    }


def _interference(config: CalibrationConfig, world: int) -> float:
    """GEMM time while an all-to-all is in flight over GEMM time alone (>= 1 means slowdown). On a
    GPU the all-to-all runs on NCCL's stream and the GEMM on the current one, timed by its events."""
    device, dtype = config.torch_device, config.torch_dtype
    x = torch.randn(config.gemm_tokens[-1], config.model_dim, device=device, dtype=dtype)
    weight = torch.randn(config.model_dim, config.hidden_dim, device=device, dtype=dtype)
    payload = torch.zeros(world * (config.collective_bytes[-1] // 4 // world), device=device)
    received = torch.empty_like(payload)

    def gemm_during_alltoall() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        work = all_to_all_single(received, payload, None, async_op=True)
        span = start_span(device)
        torch.mm(x, weight)
        span.stop()
        work.wait()
        samples.append(span.seconds())

    alone = device_medians({"gemm": lambda: torch.mm(x, weight)}, device, config.repeats)["gemm"]
    samples: list[float] = []
    for _ in range(config.repeats + 1):
        barrier()
        gemm_during_alltoall()
    return max(1.0, statistics.median(samples[1:]) / alone)


def _fit_with_holdout(name: str, points: list[tuple[float, float]], unit: str) -> tuple[Any, dict[str, Any]]:
    train, held_out = points[0::2], points[1::2]
    fit = fit_alpha_beta([p[0] for p in train], [p[1] for p in train], unit)
    error = median_relative_error(fit, [p[0] for p in held_out], [p[1] for p in held_out])
    return fit, {"fit": name, "alpha_s": fit.alpha, "beta_s_per_unit": fit.beta, "unit": unit, "r2": fit.r2,
                 "heldout_median_rel_error": error, "points": len(points)}


def _measurements(config: CalibrationConfig, world: int, kernels: KernelTable) -> dict[str, Callable[[], Any]]:
    """What a calibration measures, in order, by name: every rank runs each (the collectives and
    the interference only with more than one rank)."""
    several = world > 1
    return {
        "gemm": lambda: _gemm_points(config),
        "ffn": lambda: _ffn_points(config),
        "dispatch": lambda: _dispatch_points(config, kernels),
        **({"collectives": lambda: _collective_points(config, world),
            "interference": lambda: _interference(config, world)} if several else {}),
        "layer": lambda: _layer_points(config, world, kernels),
        **({"pipelined": lambda: _pipeline_points(config, world, kernels)} if several else {}),
    }


def _measure(measurements: dict[str, Callable[[], Any]], progress: bool) -> dict[str, Any]:
    """Each measurement's points; ``progress``: rank 0's bar of them on a terminal (a calibration
    takes minutes)."""
    from moeflow.progress import progress_bar

    measured = {}
    with progress_bar("calibrate", "fit", len(measurements), enabled=progress) as bar:
        for name, measure in measurements.items():
            bar.note(name)
            measured[name] = measure()
            bar.advance()
    return measured


def calibrate_rank(rank: int, world: int, config: CalibrationConfig, progress: bool = False) -> dict[str, Any] | None:
    """Run on every rank of an initialized process group (on CUDA: with a backend for CUDA tensors,
    :func:`process_group_backend`); rank 0 returns the profile as a dict (and shows its progress
    when ``progress``: the command's stderr is a terminal)."""
    torch.set_num_threads(1)
    device = config.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    topology = _topology(config, world)
    kernels = KernelTable()  # kernel_backend="auto"'s choice, measured once on a GPU
    measured = _measure(_measurements(config, world, kernels), progress and rank == 0)
    gemm, ffn, dispatch, layer = measured["gemm"], measured["ffn"], measured["dispatch"], measured["layer"]
    collectives, pipelined = measured.get("collectives", {}), measured.get("pipelined", {})
    interference = measured.get("interference", 1.0)
    if rank != 0:
        return None
    fits, quality = {}, []
    fits["gemm"], report = _fit_with_holdout("gemm", gemm, "m*k*n")
    quality.append(report)
    for name, points in ffn.items():
        fits[name], report = _fit_with_holdout(name, points, "m*M*H*projections")
        quality.append(report)
    for name, points in dispatch.items():
        fits[name], report = _fit_with_holdout(name, points, "bytes")
        quality.append(report)
    for name, points in collectives.items():
        fits[name], report = _fit_with_holdout(name, points, "bytes")
        quality.append(report)
    for points_by_name, unit in ((layer, "tokens"), (pipelined, "degree")):
        for name, points in points_by_name.items():
            fits[name], report = _fit_with_holdout(name, points, unit)
            quality.append(report)
    backend = dist.get_backend()
    measured_over = ("nccl" if device.type == "cuda" else "gloo") if world > 1 else NOT_MEASURED
    machine = {
        "platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "threads_per_rank": 1, "backend": backend,
        "latency_emulated": config.latency_emulated,
        "kernels": kernels.resolve("auto", device, config.torch_dtype).as_dict(),
    }
    if device.type == "cuda":
        machine |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    profile = ClusterProfile(
        nodes=topology.num_nodes, ranks_per_node=topology.ranks_per_node, fits=fits, interference=interference,
        machine=machine, quality={"fits": quality, "interference": interference},
        device=ProfileDevice(kind=device.type, name=device_name(device), dtype=config.dtype,
                             collectives=measured_over),
    )
    return profile.to_dict()


def process_group_backend(config: CalibrationConfig) -> str:
    """gloo on CPUs; on GPUs NCCL for the CUDA tensors and gloo for the host's (the slowest rank's
    times are reduced on the host)."""
    return "cpu:gloo,cuda:nccl" if config.torch_device.type == "cuda" else "gloo"


def calibrate_from_env(config: CalibrationConfig, progress: bool = False) -> dict[str, Any] | None:
    """Entry point for ranks started by ``moeflow launch`` or torchrun (env:// rendezvous); on
    CUDA, ``config.device`` is the rank's own GPU (``cuda:<local rank>``). ``progress``: as
    :func:`calibrate_rank`'s."""
    if config.torch_device.type == "cuda":
        torch.cuda.set_device(config.torch_device)  # before the first collective
    dist.init_process_group(process_group_backend(config), timeout=timedelta(seconds=120))
    try:
        return calibrate_rank(dist.get_rank(), dist.get_world_size(), config, progress)
    finally:
        destroy_process_groups()


def calibrate_in_process(config: CalibrationConfig, progress: bool = False) -> dict[str, Any]:
    """One rank in this process (``moeflow calibrate --device cuda`` without a launcher: one GPU),
    over a one-rank process group on a free local port; ``progress``: as :func:`calibrate_rank`'s."""
    if config.torch_device.type == "cuda":
        torch.cuda.set_device(config.torch_device)
    dist.init_process_group(process_group_backend(config), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=120))
    try:
        profile = calibrate_rank(0, 1, config, progress)
    finally:
        destroy_process_groups()
    assert profile is not None
    return profile
