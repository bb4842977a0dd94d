"""FasterMoE's performance model: computation (Eq. 1), topology-aware communication (Eq. 2) and the
DDL-roofline (Eq. 3-6). Plain math on numbers; no torch.distributed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def computation_latency(tokens_per_worker: Sequence[float], flops_per_token: float, flops_per_second: float) -> float:
    """Eq. 1: the slowest worker's expert GEMM time (load imbalance shows up here)."""
    return max((tokens * flops_per_token / flops_per_second for tokens in tokens_per_worker), default=0.0)


def link_traffic(bytes_matrix: Sequence[Sequence[float]], ranks_per_node: int) -> dict[tuple[str, int], float]:
    """Bytes on each directed link of an all-to-all-v: ``("up", node)`` node -> network,
    ``("down", node)`` network -> node, ``("local", rank)`` a rank's traffic to peers on its node.
    ``bytes_matrix[s][d]`` is what rank s sends to rank d."""
    traffic: dict[tuple[str, int], float] = {}
    for source, row in enumerate(bytes_matrix):
        for dest, size in enumerate(row):
            if source == dest or size == 0:
                continue
            source_node, dest_node = source // ranks_per_node, dest // ranks_per_node
            if source_node == dest_node:
                traffic[("local", source)] = traffic.get(("local", source), 0.0) + size
            else:
                traffic[("up", source_node)] = traffic.get(("up", source_node), 0.0) + size
                traffic[("down", dest_node)] = traffic.get(("down", dest_node), 0.0) + size
    return traffic


def communication_latency(
    bytes_matrix: Sequence[Sequence[float]], ranks_per_node: int, inter_bytes_per_s: float, intra_bytes_per_s: float
) -> float:
    """Eq. 2: max over directed links of traffic / bandwidth."""
    latency = 0.0
    for (kind, _), size in link_traffic(bytes_matrix, ranks_per_node).items():
        latency = max(latency, size / (intra_bytes_per_s if kind == "local" else inter_bytes_per_s))
    return latency


@dataclass(frozen=True)
class Roofline:
    """DDL-roofline quantities for one layer: R_CC (Eq. 3), ideal and semi-ideal throughput (Eq. 5-6)
    as fractions of peak, and the matching ideal latencies."""

    compute_s: float
    communicate_s: float

    @property
    def r_cc(self) -> float:
        return self.compute_s / self.communicate_s if self.communicate_s > 0 else float("inf")

    @property
    def ideal_fraction_of_peak(self) -> float:
        return min(1.0, self.r_cc)

    @property
    def semi_ideal_fraction_of_peak(self) -> float:
        r = self.r_cc
        return 1.0 if r == float("inf") else r / (r + 1.0)

    @property
    def ideal_s(self) -> float:
        """Full overlap: max(t_comp, t_comm)."""
        return max(self.compute_s, self.communicate_s)

    @property
    def semi_ideal_s(self) -> float:
        """No overlap: t_comp + t_comm."""
        return self.compute_s + self.communicate_s
