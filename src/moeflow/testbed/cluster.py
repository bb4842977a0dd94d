"""An emulated multi-node cluster on one machine: one network namespace per node.

Each node namespace holds one end of a veth pair; the other ends join a bridge inside a private hub
namespace, so nothing touches the host's own network. ``tc`` shapes every node's link in both
directions (node egress and hub egress towards the node): bandwidth always, latency and jitter when
the kernel has ``sch_netem``. Ranks of one node reach each other through that node's loopback (the
fast intra-node link); ranks of different nodes go through the shaped veth links.

Without ``sch_netem`` (probed at start-up) latency cannot be emulated: the cluster says so on stderr
and records ``latency_emulated: false`` in :meth:`EmulatedCluster.info`, which benchmarks print.
Everything created is removed by :meth:`EmulatedCluster.down`, also on errors and signals.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

SUBNET = "10.231.0"  # lives only inside this cluster's own namespaces and bridge
_PREFIX = "mf"
_counter = itertools.count()


class ClusterError(RuntimeError):
    """The emulated cluster cannot be created here (not root, tools missing, a command failed)."""


@dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster: nodes, ranks per node, and the inter-node links' bandwidth (Gbit/s),
    latency and jitter (microseconds)."""

    nodes: int
    ranks_per_node: int
    inter_gbit: float = 1.0
    inter_latency_us: float = 0.0
    inter_jitter_us: float = 0.0

    def __post_init__(self) -> None:
        if not (1 <= self.nodes <= 200):
            raise ValueError(f"nodes must be between 1 and 200, got {self.nodes}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if not self.inter_gbit > 0:
            raise ValueError(f"inter_gbit must be > 0, got {self.inter_gbit}")
        if self.inter_latency_us < 0 or self.inter_jitter_us < 0:
            raise ValueError("inter_latency_us and inter_jitter_us must be >= 0")
        if self.inter_jitter_us > self.inter_latency_us:
            raise ValueError(
                f"inter_jitter_us={self.inter_jitter_us} exceeds inter_latency_us={self.inter_latency_us}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth and tc); run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs {' and '.join(missing)} (Debian package iproute2)"
    return None


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise ClusterError(f"{' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}")


class EmulatedCluster:
    """Context manager: ``with EmulatedCluster(spec) as cluster: cluster.exec_prefix(node) + cmd``."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.prefix = f"{_PREFIX}{os.getpid()}x{next(_counter)}"  # namespaces: the pid finds stale ones
        self.link_prefix = f"{_PREFIX}{secrets.token_hex(3)}"  # veth names: 15 characters at most
        self.hub = f"{self.prefix}hub"
        self.latency_emulated = False
        self._created: list[str] = []

    # -- names ---------------------------------------------------------------------------------

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def interface(self, node: int) -> str:
        """The node's link interface (inside its namespace): gloo binds to it."""
        return f"{self.link_prefix}v{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node)]

    def info(self) -> dict[str, Any]:
        return {**asdict(self.spec), "latency_emulated": self.latency_emulated, "namespaces": self._created}

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise ClusterError(reason)
        try:
            self._add_namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            self.latency_emulated = self._netem_available()
            wants_latency = self.spec.inter_latency_us > 0 or self.spec.inter_jitter_us > 0
            if wants_latency and not self.latency_emulated:
                print(
                    "moeflow testbed: WARNING this kernel has no sch_netem qdisc; inter-node latency and "
                    "jitter are NOT emulated, only bandwidth (tbf). Results record latency_emulated=false.",
                    file=sys.stderr, flush=True,
                )
            for node in range(self.spec.nodes):
                self._add_node(node)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Delete every namespace this cluster made (their veths go with them)."""
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._created.clear()

    # -- pieces --------------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _add_node(self, node: int) -> None:
        namespace, link, hub_end = self.namespace(node), self.interface(node), f"{self.link_prefix}h{node}"
        self._add_namespace(namespace)
        _run("ip", "link", "add", link, "type", "veth", "peer", "name", hub_end)
        _run("ip", "link", "set", link, "netns", namespace)
        _run("ip", "link", "set", hub_end, "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
        _run("ip", "-n", self.hub, "link", "set", hub_end, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{self.address(node)}/24", "dev", link)
        _run("ip", "-n", namespace, "link", "set", link, "up")
        # each direction gets half the one-way latency and the full bandwidth of the node's NIC
        self._shape(namespace, link)
        self._shape(self.hub, hub_end)

    def _shape(self, namespace: str, device: str) -> None:
        spec = self.spec
        rate = f"{spec.inter_gbit}gbit"
        if self.latency_emulated:
            qdisc = ["netem", "delay", f"{spec.inter_latency_us / 2}us"]
            if spec.inter_jitter_us:
                qdisc.append(f"{spec.inter_jitter_us / 2}us")
            qdisc += ["rate", rate, "limit", "100000"]
        else:
            burst_bytes = max(65536, int(spec.inter_gbit * 1e9 / 8 / 1000))  # one millisecond of traffic
            qdisc = ["tbf", "rate", rate, "burst", str(burst_bytes), "latency", "100ms"]
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", *qdisc)

    def _netem_available(self) -> bool:
        probe = subprocess.run(
            ["ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"],
            capture_output=True, timeout=30,
        )
        return probe.returncode == 0


def stale_namespaces() -> list[str]:
    """moeflow namespaces whose creating process is gone (left by a killed run)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    stale = []
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(_PREFIX) or "x" not in name:
            continue
        pid_text = name[len(_PREFIX) : name.index("x")]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            stale.append(name)
    return stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
