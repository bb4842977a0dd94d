"""The simulated cluster: nodes x GPUs per node, their links and their compute rates.

A cluster is read from TOML (named profiles ship in ``moeflow/perf/sim/profiles``; users pass a path)
in the units papers publish (Gbit/s, microseconds, TFLOP/s) and held in SI units. Every figure of a
shipped profile carries a note in ``[sources]`` saying where it comes from.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from moeflow.config import ALLTOALL_ALGORITHMS

SCALED_COLLECTIVES = (*ALLTOALL_ALGORITHMS, "allreduce", "allgather", "reducescatter")
"""The collectives a cluster can price off their ideal: the all-to-all algorithms by name."""
GBIT = 1e9 / 8  # bytes per second in one Gbit/s
MICRO = 1e-6


@dataclass(frozen=True)
class Device:
    """One accelerator: achieved GEMM rate, fixed cost per kernel, memory bandwidth (encode, decode,
    layout copies, optimizer), the backward's FLOPs over the forward's, and how much slower expert
    compute runs while its rank's all-to-all is in flight (communication kernels take SMs and
    memory bandwidth on a GPU, the transport's copies take the core of a CPU rank). A layer call
    also pays a fixed host cost beyond its kernels (routing bookkeeping, the load exchange, Python,
    autograd), forward and backward: calibrated on a CPU cluster, 0 where the papers' GPUs hide it
    behind asynchronous launches."""

    name: str
    gemm_flops: float
    kernel_overhead_s: float
    memory_bandwidth: float
    backward_ratio: float = 2.0
    overlap_slowdown: float = 1.0
    layer_call_s: float = 0.0
    layer_call_backward_s: float = 0.0
    copy_bandwidth: float = 0.0  # bytes/s of 2DH's stride copies; 0: memory_bandwidth
    chunk_s: float = 0.0  # host cost of each pipeline chunk beyond the first, per pass (calibrated on CPU)
    cores: int = 0  # cores that ranks_per_machine ranks share (a CPU cluster); 0: every rank has its own device
    ranks_per_machine: int = 0


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction (bytes/s), latency paid once per sequential step, and
    the occupancy of each message on the link (LogGP's gap: what makes many small messages slow),
    which grows by ``message_overhead_per_peer_s`` with each peer a rank exchanges with over the
    link in one collective (NCCL's linear all-to-all starts up superlinearly in the rank count)."""

    bandwidth: float
    latency_s: float
    message_overhead_s: float
    message_overhead_per_peer_s: float = 0.0

    def gap_s(self, peers: float = 1.0) -> float:
        """One message's occupancy of the link when its sender exchanges with ``peers`` ranks over it."""
        return self.message_overhead_s + self.message_overhead_per_peer_s * peers


@dataclass(frozen=True)
class Cluster:
    """``intra`` is each GPU's link to the others of its node; ``nic`` is one NIC, of which every
    node has ``nics_per_node`` (a node's inter-node traffic spreads over them)."""

    name: str
    nodes: int
    gpus_per_node: int
    device: Device
    intra: Link
    nic: Link
    nics_per_node: int = 1
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    collective_scale: dict[str, float] = field(default_factory=dict)
    """Per collective (an all-to-all algorithm, allreduce, allgather, reducescatter), its link time
    over the ideal (1 when absent): an implementation that reaches half the links' rate (gloo's
    linear all-to-all does on the emulated cluster) has 2."""
    collective_latency: dict[str, float] = field(default_factory=dict)
    """Per collective, seconds each call takes beyond its steps' own latencies (0 when absent): the
    intercept of a calibrated twin's fit of that collective over what its links already charge
    (gloo's pairwise exchange starts slower than its linear one)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def node_bandwidth(self) -> float:
        return self.nic.bandwidth * self.nics_per_node

    def node_message_overhead_s(self, peers: float = 1.0) -> float:
        """A node's NICs take messages in parallel: each costs the node 1 / nics of one NIC's gap."""
        return self.nic.gap_s(peers) / self.nics_per_node

    def resized(self, nodes: int, gpus_per_node: int | None = None) -> Cluster:
        """The same hardware with another node count (what the papers' scaling curves vary)."""
        from dataclasses import replace

        per_node = self.gpus_per_node if gpus_per_node is None else gpus_per_node
        _positive("nodes", nodes, "the cluster's node count")
        _positive("gpus_per_node", per_node, "the GPUs of one node")
        return replace(self, nodes=nodes, gpus_per_node=per_node)

    def expert_group(self, ep: int) -> Cluster:
        """The cluster one expert-parallel group of ``ep`` consecutive ranks sees: its own ranks and
        links (every group runs alike). A group tiles the nodes: it divides a node or spans whole ones."""
        world, per_node = self.world_size, self.gpus_per_node
        if ep == world:
            return self
        if ep < 1 or world % ep or (per_node % ep and ep % per_node):
            raise ValueError(f"ep ({ep}) must divide the {world} ranks and either divide the {per_node} GPUs per "
                             "node or be a multiple of them (expert groups tile the nodes)")
        return self.resized(1, ep) if ep <= per_node else self.resized(ep // per_node)


class ClusterFileError(ValueError):
    """A cluster profile that cannot be used; the message names the file and the field."""


FIELDS: dict[str, tuple[tuple[str, float, bool], ...]] = {
    # table: (key, unit scale, required)
    "topology": (("nodes", 1, True), ("gpus_per_node", 1, True)),
    "device": (("gemm_tflops", 1e12, True), ("kernel_overhead_us", MICRO, True),
               ("memory_bandwidth_gb_s", 1e9, True), ("backward_ratio", 1, False), ("overlap_slowdown", 1, False),
               ("layer_call_us", MICRO, False), ("layer_call_backward_us", MICRO, False),
               ("stride_copy_gb_s", 1e9, False), ("chunk_us", MICRO, False)),
    "intra_node": (("bandwidth_gbit_s", GBIT, True), ("latency_us", MICRO, True), ("message_overhead_us", MICRO, True)),
    "inter_node": (("nic_bandwidth_gbit_s", GBIT, True), ("nics_per_node", 1, False), ("latency_us", MICRO, True),
                   ("message_overhead_us", MICRO, True), ("message_overhead_per_peer_us", MICRO, False)),
}


def cluster_from_toml(text: str, origin: str = "<string>") -> Cluster:
    """Parse and check a profile; every missing or bad field is reported with its table and key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ClusterFileError(f"cluster profile {origin}: not valid TOML ({error})") from None
    values = {table: _table(data, table, origin) for table in FIELDS}
    device = values["device"]
    intra, inter = values["intra_node"], values["inter_node"]
    return Cluster(
        name=str(data.get("name", Path(origin).stem)), nodes=int(values["topology"]["nodes"]),
        gpus_per_node=int(values["topology"]["gpus_per_node"]),
        device=Device(str(data.get("device", {}).get("name", "")), device["gemm_tflops"], device["kernel_overhead_us"],
                      device["memory_bandwidth_gb_s"], device.get("backward_ratio", 2.0),
                      device.get("overlap_slowdown", 1.0), device.get("layer_call_us", 0.0),
                      device.get("layer_call_backward_us", 0.0), device.get("stride_copy_gb_s", 0.0),
                      device.get("chunk_us", 0.0)),
        intra=Link(intra["bandwidth_gbit_s"], intra["latency_us"], intra["message_overhead_us"]),
        nic=Link(inter["nic_bandwidth_gbit_s"], inter["latency_us"], inter["message_overhead_us"],
                 inter.get("message_overhead_per_peer_us", 0.0)),
        nics_per_node=int(inter.get("nics_per_node", 1)), description=str(data.get("description", "")),
        sources={str(k): str(v) for k, v in data.get("sources", {}).items()},
        collective_scale=_collective_scale(data, origin),
    )


def _collective_scale(data: dict[str, Any], origin: str) -> dict[str, float]:
    """The optional ``[collective_scale]`` table: a positive number per known collective."""
    section = data.get("collective_scale", {})
    if not isinstance(section, dict):
        raise ClusterFileError(f"cluster profile {origin}: collective_scale must be a table")
    for key, value in section.items():
        if key not in SCALED_COLLECTIVES:
            raise ClusterFileError(f"cluster profile {origin}: collective_scale.{key} is not a collective; "
                                   f"use {', '.join(SCALED_COLLECTIVES)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ClusterFileError(
                f"cluster profile {origin}: collective_scale.{key} must be a number > 0, got {value!r}")
    return {str(k): float(v) for k, v in section.items()}


def _table(data: dict[str, Any], table: str, origin: str) -> dict[str, float]:
    section = data.get(table)
    if not isinstance(section, dict):
        raise ClusterFileError(f"cluster profile {origin}: missing table [{table}]; "
                               "see moeflow/perf/sim/profiles/*.toml")
    out: dict[str, float] = {}
    for key, scale, required in FIELDS[table]:
        if key not in section:
            if required:
                raise ClusterFileError(f"cluster profile {origin}: missing field {table}.{key}; add it to [{table}]")
            continue
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ClusterFileError(f"cluster profile {origin}: {table}.{key} must be a number, got {value!r}")
        zero_ok = key.endswith("_us")
        if value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise ClusterFileError(f"cluster profile {origin}: {table}.{key} must be {bound}, got {value!r}")
        integral = key in ("nodes", "gpus_per_node", "nics_per_node")
        if integral and int(value) != value:
            raise ClusterFileError(f"cluster profile {origin}: {table}.{key} must be an integer, got {value!r}")
        out[key] = value * scale
    return out


def _positive(name: str, value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({what}), got {value!r}")


def shipped_names(folder: str) -> list[str]:
    """The TOML files shipped in ``moeflow/sim/<folder>``, by name."""
    root = resources.files("moeflow.perf.sim") / folder
    if not root.is_dir():
        return []
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def read_toml_source(name_or_path: str | Path, folder: str, what: str) -> tuple[str, str]:
    """The text and origin of a TOML file given by path, or shipped in ``folder`` by name;
    ``ClusterFileError`` (a ValueError) names what is missing and what exists."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ClusterFileError(f"no {what} at {path}; shipped: {', '.join(shipped_names(folder))}")
        return path.read_text(), str(path)
    if str(name_or_path) not in shipped_names(folder):
        raise ClusterFileError(
            f"unknown {what} {str(name_or_path)!r}; pass a TOML path or one of: {', '.join(shipped_names(folder))}"
        )
    return (resources.files("moeflow.perf.sim") / folder / f"{name_or_path}.toml").read_text(), f"{name_or_path}.toml"


def named_clusters() -> list[str]:
    """The profiles shipped with moeflow, by name."""
    return shipped_names("profiles")
