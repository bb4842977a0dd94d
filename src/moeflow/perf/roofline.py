"""FasterMoE's performance model: topology-aware communication (Eq. 2: the busiest link of an
all-to-all-v) and the DDL-roofline (Eq. 3-6). Plain math on numbers; no torch.distributed.
Eq. 1 (the slowest worker's computation) is the max over ranks in the shadowing decision
(:mod:`moeflow.perf.shadowing`), which prices its exchange with Eq. 2."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def link_loads(bytes_WW: np.ndarray, ranks_per_node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes on each directed link of an all-to-all-v (``bytes_WW[s, d]``: what rank s sends rank
    d): per node, up (node -> network) and down (network -> node), and per rank, local (to its
    peers on its own node). Ranks are numbered node-major."""
    sent = np.array(bytes_WW, dtype=np.float64, copy=True)
    np.fill_diagonal(sent, 0.0)
    ranks = sent.shape[0]
    node = np.arange(ranks) // ranks_per_node
    same_node = node[:, None] == node[None, :]
    remote = np.where(same_node, 0.0, sent)
    nodes = -(-ranks // ranks_per_node)
    up = np.bincount(node, weights=remote.sum(1), minlength=nodes)
    down = np.bincount(node, weights=remote.sum(0), minlength=nodes)
    return up, down, np.where(same_node, sent, 0.0).sum(1)


def communication_latency(
    bytes_WW: np.ndarray, ranks_per_node: int, inter_s_per_byte: float, intra_s_per_byte: float
) -> float:
    """Eq. 2: the busiest directed link's traffic times its seconds per byte."""
    up, down, local = link_loads(bytes_WW, ranks_per_node)
    inter = max(float(up.max(initial=0.0)), float(down.max(initial=0.0))) * inter_s_per_byte
    return max(inter, float(local.max(initial=0.0)) * intra_s_per_byte)


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
