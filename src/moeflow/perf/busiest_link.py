"""FasterMoE's topology-aware communication model (Eq. 2: the busiest link of an all-to-all-v).
Plain math on numbers; no torch.distributed. Eq. 1 (the slowest worker's computation) is the max
over ranks in the shadowing decision (:mod:`moeflow.perf.shadowing`), which prices its exchange
with Eq. 2. FasterMoE's DDL-roofline (Eq. 3-6) is an analysis in the paper, not a decision, and
moeflow does not carry it (the calibration and planner guide says why)."""

from __future__ import annotations

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
