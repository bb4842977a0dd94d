"""Lina's question for every copy of an expert (§5.2, §6.2): does it pay for its weights?

A replica placement runs a layer's experts on more ranks than store them, which evens the ranks'
compute and changes the rows each rank sends, but its copies' weights (3 M H elements each for a
SwiGLU expert) must cross the links first. :class:`ReplicaPrices` prices one layer under a plan:
the busiest rank's expert compute (each expert's load split evenly over its copies, one FFN call
per expert), the rows there and back priced per link (FasterMoE's Eq. 2, :class:`LinkPrices`,
each rank assumed to send 1 / W of every expert's load: the estimate is summed over ranks), and
the copies' weights over the same links, less the seconds they hide under (phase 1 fetches a
layer ahead, under that layer's expert compute; phase 2 fetches on the critical path: none). A
copy that does not lower that total is not made: on a slow link the plan stays the static one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.config import LayerDims
from moeflow.perf.cost import CostModel
from moeflow.perf.shadowing import LinkPrices


@dataclass(frozen=True)
class ReplicaPrices:
    """What one layer's replica placement costs: ``expert_seconds(rows)``, one expert's forward
    over ``rows`` tokens; ``links``, an exchange per link; a token's and an expert's bytes."""

    expert_seconds: Callable[[float], float]
    links: LinkPrices
    row_bytes: int
    expert_bytes: int

    @classmethod
    def from_cost_model(cls, cost: CostModel, dims: LayerDims, bytes_per_element: int) -> ReplicaPrices:
        """Prices from a calibrated profile, for a layer of ``dims`` in ``bytes_per_element``."""

        def expert_seconds(rows: float) -> float:
            if rows <= 0:
                return 0.0
            return cost.t_ffn(max(1, round(rows)), dims.model_dim, dims.hidden_dim, dims.projections)

        return cls(expert_seconds, LinkPrices.from_cost_model(cost), dims.model_dim * bytes_per_element,
                   dims.expert_parameters * bytes_per_element)

    def compute_seconds(self, plan: Sequence[Sequence[int]], load_E: np.ndarray) -> float:
        """The busiest rank's expert compute."""
        share = np.asarray(load_E, dtype=np.float64) / _copies(plan, len(load_E))
        return max((sum(self.expert_seconds(share[e]) for e in experts) for experts in plan), default=0.0)

    def exchange_seconds(self, plan: Sequence[Sequence[int]], load_E: np.ndarray) -> float:
        """The rows to the ranks that compute them and back: two exchanges."""
        world = len(plan)
        share = np.asarray(load_E, dtype=np.float64) / _copies(plan, len(load_E))
        received = np.array([share[list(experts)].sum() for experts in plan]) / world * self.row_bytes
        bytes_WW = np.tile(received, (world, 1))
        np.fill_diagonal(bytes_WW, 0.0)
        return 2 * self.links.exchange_seconds(bytes_WW)

    def copy_seconds(self, plan: Sequence[Sequence[int]], storage: Sequence[Sequence[int]]) -> float:
        """The copies' weights from their owners (the first rank storing each) to where they run."""
        owner = {e: r for r, experts in reversed(list(enumerate(storage))) for e in experts}
        bytes_WW = np.zeros((len(plan), len(plan)))
        for rank, experts in enumerate(plan):
            for expert in set(experts) - set(storage[rank]):
                bytes_WW[owner[expert], rank] += self.expert_bytes
        return self.links.exchange_seconds(bytes_WW)

    def seconds(self, plan: Sequence[Sequence[int]], load_E: np.ndarray, storage: Sequence[Sequence[int]],
                hidden_s: float = 0.0) -> float:
        """The layer under ``plan``: compute, exchange, and the copies' time beyond ``hidden_s``."""
        copies = max(0.0, self.copy_seconds(plan, storage) - hidden_s)
        return self.compute_seconds(plan, load_E) + self.exchange_seconds(plan, load_E) + copies


def _copies(plan: Sequence[Sequence[int]], num_experts: int) -> np.ndarray:
    copies = np.zeros(num_experts)
    for experts in plan:
        copies[list(experts)] += 1
    return np.maximum(copies, 1)
