"""The simulated twin of a calibrated cluster: link and device rates read off the alpha-beta fits
that ``moeflow calibrate`` measured, so that the simulator can be checked against the machine.

The links come from the primitive fits (one linear all-to-all inside a node, one across nodes), the
device from the expert FFN's and the GEMM's. Each collective's own fit (every all-to-all algorithm,
all-reduce, all-gather, reduce-scatter) then gives its ``collective_scale``: how much slower than
the links that implementation runs. The fixed cost of a layer call is what the fits of one small
layer's whole call (``layer.forward``, ``layer.backward``) leave over the twin's own time for that
layer. When one runs faster than the linear all-to-all the links were
read from, the links are that much faster (gloo's linear exchange reaches about half the rate its
pairwise exchange and all-reduce reach here). The layer's and step's times (pipelining, overlap,
compute, contention) are a prediction, not a copy.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from moeflow.config import ALLTOALL_ALGORITHMS, LayerDims
from moeflow.perf.alphabeta import AlphaBeta
from moeflow.perf.profile import LAYER_PROBE, PIPELINE_PROBE, ClusterProfile
from moeflow.perf.sim.builder import ffn_kernels
from moeflow.perf.sim.cluster import Cluster, Device, Link, cluster_from_toml, read_toml_source
from moeflow.perf.sim.network import LocalCopy, Network, Step, Transfer
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.workload import ModelSpec
from moeflow.sim.step import simulate_step

PROBE_BYTES = 1 << 20
"""Per-rank buffer at which an algorithm's ideal slope is read (the network model is linear in bytes)."""

CALIBRATED_FFN_KERNELS = ffn_kernels(2)
"""Kernels the simulator counts for the expert FFN ``moeflow calibrate`` times (2 projections): the
calibrated ``ffn.forward`` alpha is one such call's, not one kernel's."""

ASSUMED_MEMORY_BANDWIDTH = 10e9
"""Bytes/s of encode, decode and layout copies: calibration does not measure it; a CPU socket's
order of magnitude, and those copies are a small share of a step."""


def cluster_from_profile(profile: ClusterProfile, name: str = "calibrated") -> Cluster:
    """A :class:`Cluster` whose links and device reproduce ``profile``'s primitive fits."""
    per_node, nodes = profile.ranks_per_node, profile.nodes
    intra = _link(profile.fits.get("alltoall.intra_node"), per_node)
    inter = _link(profile.fits.get("alltoall.inter_node"), nodes)
    if intra is None and inter is None:
        raise ValueError("the profile has neither alltoall.intra_node nor alltoall.inter_node; "
                         "calibrate with 2 or more ranks (moeflow calibrate --workers 2)")
    sources = {
        "intra_node": "fit alltoall.intra_node: bandwidth (g - 1) / (g beta), latency alpha" if intra else
        "one rank per node: no intra-node link (copied from inter_node, never used)",
        "inter_node": "fit alltoall.inter_node: bandwidth (n - 1) / (n beta), latency alpha" if inter else
        "one node: no inter-node link (copied from intra_node, never used)",
        "device": "fits ffn.forward / ffn.backward (x = m M H projections, 2 FLOPs each; one call's alpha "
                  f"spread over its {CALIBRATED_FFN_KERNELS} kernels) or gemm's",
        "device.overlap_slowdown": "the profile's interference: a GEMM's slowdown under an all-to-all in flight",
        "device.memory_bandwidth": f"not calibrated: assumed {ASSUMED_MEMORY_BANDWIDTH / 1e9:g} GB/s",
    }
    twin = Cluster(
        name=name, nodes=nodes, gpus_per_node=per_node, device=_device(profile),
        intra=intra or inter, nic=inter or intra, nics_per_node=1,
        description=f"calibrated: {nodes} node(s) x {per_node} rank(s), {profile.machine.get('host', '')}".strip(),
        sources=sources,
    )
    scale = collective_scales(twin, profile)
    fastest = min(scale.values(), default=1.0)
    if fastest < 1.0:  # an algorithm beats the linear fit: the links are that much faster (gloo's
        # linear exchange reaches about half the rate its pairwise and all-reduce reach)
        twin = replace(twin, intra=_faster(twin.intra, fastest), nic=_faster(twin.nic, fastest))
        scale = {k: v / fastest for k, v in scale.items()}
        sources["intra_node"] += f"; times {1 / fastest:.2f}: the fastest all-to-all's fit"
        sources["inter_node"] += f"; times {1 / fastest:.2f}: the fastest all-to-all's fit"
    sources["collective_scale"] = "each collective's fitted slope over the twin's ideal slope: " + \
        ", ".join(f"{k} {v:.2f}" for k, v in scale.items())
    return _with_fitted_costs(replace(twin, collective_scale=scale), profile)


def _with_fitted_costs(twin: Cluster, profile: ClusterProfile) -> Cluster:
    """The twin with the costs its links and device leave unexplained, each read off its fit on the
    twin so far, in this order: each collective's start-up, the layer call, the cores its ranks
    share, the pipeline chunks (each said in the twin's ``sources``)."""
    sources = twin.sources
    latency = collective_latencies(twin, profile)
    if latency:
        sources["collective_latency"] = "each collective's fitted intercept beyond its steps' own: " + \
            ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in latency.items())
        twin = replace(twin, collective_latency=latency)
    forward, backward = layer_call_costs(twin, profile)
    if forward or backward:
        sources["device.layer_call"] = ("fits layer.forward / layer.backward (LAYER_PROBE's layer) minus the twin's "
                                        f"own time for that layer, mean over its token counts: {forward * 1e3:.2f} ms "
                                        f"forward, {backward * 1e3:.2f} ms backward")
    twin = replace(twin, device=replace(twin.device, layer_call_s=forward, layer_call_backward_s=backward))
    cores, sharing = shared_cores(profile)
    if cores:
        sources["device.cores"] = (f"the machine's {cores} cores, shared by {sharing} ranks (a skewed load's idle "
                                   "ranks pass theirs to the busy ones)")
        twin = replace(twin, device=replace(twin.device, cores=cores, ranks_per_machine=sharing))
    chunk = fitted_chunk_cost(twin, profile)
    if chunk is not None:
        sources["device.chunk"] = (
            f"fit layer.pipelined (PIPELINE_PROBE's layer at degrees 1 and {PIPELINE_PROBE['compared']}): what "
            f"each further chunk cost there beyond the twin's own prediction, per pass: {chunk * 1e3:.2f} ms")
        twin = replace(twin, device=replace(twin.device, chunk_s=chunk))
    return twin


def shared_cores(profile: ClusterProfile) -> tuple[int, int]:
    """(cores, ranks) of a machine whose ranks share its cores, from the profile's machine record:
    on the emulated cluster every rank runs on the calibrating machine, elsewhere a node's ranks
    do; (0, 0) where each rank has a core (or a GPU) of its own or the record does not say."""
    machine = profile.machine
    threads = int(machine.get("threads_per_rank") or 1)
    cpus = int(machine.get("cpus") or 0)
    emulated = machine.get("latency_emulated") is not None
    ranks = profile.nodes * profile.ranks_per_node if emulated else profile.ranks_per_node
    cores = cpus // threads
    if machine.get("backend") != "gloo" or not cores or cores >= ranks:
        return 0, 0
    return cores, ranks


def probe_model(probe: Mapping[str, Any], world: int, tokens: int, name: str) -> ModelSpec:
    """One layer of a calibration probe's shape (:data:`LAYER_PROBE`, :data:`PIPELINE_PROBE`) on
    ``world`` ranks at ``tokens`` per rank, fp32, capacity factor 1, without the biases the
    simulator does not count."""
    dims = LayerDims(probe["model_dim"], probe["hidden_dim"], probe["experts_per_rank"] * world,
                     top_k=probe["top_k"], bias=False)
    return ModelSpec(name=name, layers=1, dims=dims, capacity_factor=1.0, tokens_per_rank=tokens, dtype="fp32")


def layer_call_costs(twin: Cluster, profile: ClusterProfile) -> tuple[float, float]:
    """Seconds per layer call, forward and backward, that the twin (without them) leaves
    unexplained of :data:`LAYER_PROBE`'s measured calls; (0, 0) for a profile without those fits."""
    fits = profile.fits
    if "layer.forward" not in fits or "layer.backward" not in fits:
        return 0.0, 0.0
    forward, backward = [], []
    for tokens in LAYER_PROBE["tokens"]:
        model = probe_model(LAYER_PROBE, twin.world_size, tokens, "layer-probe")
        ahead = simulate_step(twin, model, training=False, layer_only=True).step_s
        both = simulate_step(twin, model, layer_only=True).step_s
        forward.append(fits["layer.forward"](tokens) - ahead)
        backward.append(fits["layer.backward"](tokens) - (both - ahead))
    return max(0.0, statistics.mean(forward)), max(0.0, statistics.mean(backward))


def fitted_chunk_cost(twin: Cluster, profile: ClusterProfile) -> float | None:
    """Seconds per pass (forward, backward) that each pipeline chunk beyond the first adds to a layer
    call beyond the twin's own prediction, from the ``layer.pipelined`` fit of :data:`PIPELINE_PROBE`'s
    layer (its time at the highest probe degree against degree 1); None without that fit. Where
    ranks share cores, overlap gains little and every chunk costs thread and process switches."""
    if "layer.pipelined" not in profile.fits:
        return None
    fit, degree = profile.fits["layer.pipelined"], PIPELINE_PROBE["compared"]
    model = probe_model(PIPELINE_PROBE, twin.world_size, PIPELINE_PROBE["tokens"], "pipeline-probe")
    plain = replace(twin, device=replace(twin.device, chunk_s=0.0))
    predicted = (simulate_step(plain, model, StepPlan(degree=degree), layer_only=True).step_s
                 - simulate_step(plain, model, StepPlan(), layer_only=True).step_s)
    return max(0.0, (fit(degree) - fit(1) - predicted) / (degree - 1) / 2)


def retimed(cluster: Cluster, speed: float) -> Cluster:
    """The twin with its device ``speed`` times as fast (``speed`` < 1: slower): the rate the
    machine ran at during a measurement, read off a speed probe, over the rate at calibration."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed!r}")
    device = cluster.device
    return replace(cluster, device=replace(device, gemm_flops=device.gemm_flops * speed,
                                           kernel_overhead_s=device.kernel_overhead_s / speed,
                                           layer_call_s=device.layer_call_s / speed,
                                           layer_call_backward_s=device.layer_call_backward_s / speed,
                                           chunk_s=device.chunk_s / speed,
                                           memory_bandwidth=device.memory_bandwidth * speed,
                                           copy_bandwidth=device.copy_bandwidth * speed))


def _faster(link: Link, factor: float) -> Link:
    return replace(link, bandwidth=link.bandwidth / factor)


def _collective_probes(twin: Cluster) -> dict[str, tuple[str, Callable[[float], list[Step]]]]:
    """Per collective: its fit's name and its steps on the twin for a per-rank buffer of x bytes."""
    network = Network(twin)
    probes: dict[str, tuple[str, Callable[[float], list[Step]]]] = {
        algorithm: (f"alltoall.{algorithm}", lambda x, a=algorithm: network.alltoall(a, x / twin.world_size))
        for algorithm in ALLTOALL_ALGORITHMS}
    probes |= {"allreduce": ("allreduce", network.allreduce), "allgather": ("allgather", network.allgather),
               "reducescatter": ("reducescatter", network.reducescatter)}
    return probes


def collective_latencies(twin: Cluster, profile: ClusterProfile) -> dict[str, float]:
    """Per collective with a fit: its intercept (a call's start-up) beyond what the twin's steps
    already take for a one-byte call (their latencies and per-message gaps), where positive."""
    out = {}
    if twin.world_size < 2:
        return out
    for name, (fit_name, steps_of) in _collective_probes(twin).items():
        fit = profile.fits.get(fit_name)
        if fit is None:
            continue
        empty = sum(s.alone_s for s in steps_of(1.0) if isinstance(s, Transfer))  # one byte: every step is there
        if fit.alpha > empty:
            out[name] = fit.alpha - empty
    return out


def collective_scales(twin: Cluster, profile: ClusterProfile) -> dict[str, float]:
    """Per collective with a fit: its measured seconds per byte over what the twin's links give
    (copies between phases are not scaled, so they are taken off the measured slope first)."""
    out = {}
    if twin.world_size < 2:
        return out
    for name, (fit_name, steps_of) in _collective_probes(twin).items():
        fit = profile.fits.get(fit_name)
        if fit is None or fit.beta <= 0:
            continue
        steps = steps_of(PROBE_BYTES)
        copies = sum(2 * s.bytes_per_rank / twin.device.memory_bandwidth for s in steps if isinstance(s, LocalCopy))
        links = sum(float(s.work.max(initial=0.0)) for s in steps if not isinstance(s, LocalCopy))
        if links > 0:
            out[name] = max(fit.beta * PROBE_BYTES - copies, 0.1 * links) / links
    return out


def _link(fit: AlphaBeta | None, group: int) -> Link | None:
    """A linear all-to-all over ``group`` ranks of x bytes each moves (group - 1) / group x over
    every rank's link: the fit's slope is that share over the bandwidth."""
    if fit is None or group < 2 or fit.beta <= 0:
        return None
    return Link(bandwidth=(group - 1) / (group * fit.beta), latency_s=fit.alpha, message_overhead_s=0.0)


def _device(profile: ClusterProfile) -> Device:
    fits = profile.fits
    if "ffn.forward" in fits:
        forward = fits["ffn.forward"]
        backward = fits.get("ffn.backward")
        ratio = backward.beta / forward.beta if backward is not None and forward.beta > 0 else 2.0
        rate, overhead = 2.0 / forward.beta, forward.alpha / CALIBRATED_FFN_KERNELS
    elif "gemm" in fits:
        rate, overhead, ratio = 2.0 / fits["gemm"].beta, fits["gemm"].alpha, 2.0
    else:
        raise ValueError("the profile has neither ffn.forward nor gemm fits; re-run moeflow calibrate")
    return Device(name=str(profile.machine.get("processor", "calibrated")), gemm_flops=rate,
                  kernel_overhead_s=overhead, memory_bandwidth=ASSUMED_MEMORY_BANDWIDTH, backward_ratio=ratio,
                  overlap_slowdown=max(profile.interference, 1.0))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A shipped profile by name, a TOML file by path, or a calibrated JSON profile's twin."""
    path = Path(name_or_path)
    if path.suffix == ".json":  # a calibrated profile: its simulated twin
        return cluster_from_profile(ClusterProfile.load(path), path.stem)
    return cluster_from_toml(*read_toml_source(name_or_path, "profiles", "cluster"))
