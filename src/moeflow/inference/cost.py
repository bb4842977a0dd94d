"""Lina's question for every copy of an expert (§5.2, §6.2): does it pay for its weights?

A replica placement runs a layer's experts on more ranks than store them, which evens the ranks'
compute and changes the rows each rank sends, but its copies' weights (3 M H elements each for a
SwiGLU expert) must cross the links first. :class:`ReplicaPrices` prices one layer under a plan:
the busiest rank's expert compute (each expert's load split evenly over its copies, one FFN call
per expert), the rows there and back priced per link (FasterMoE's Eq. 2, :class:`LinkPrices`,
each rank assumed to send 1 / W of every expert's load: the estimate is summed over ranks), and
the copies' weights over the same links, less the seconds they hide under (phase 1 fetches a
layer ahead, under that layer's expert compute where the device moves them on its own engine, a
GPU's; a CPU rank's core moves them itself, and phase 2 fetches on the critical path: none). A
copy that does not lower that total is not made: on a slow link the plan stays the static one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.config import LayerDims
from moeflow.perf.cost import CostModel
from moeflow.perf.shadowing import LinkPrices


@dataclass(frozen=True)
class ReplicaPrices:
    """What one layer's replica placement costs: one expert's forward over r rows is
    ``expert_call_s + r * expert_row_s`` (the profile's fit is affine in the rows); ``links``
    prices an exchange per link; a token's and an expert's bytes."""

    expert_call_s: float
    expert_row_s: float
    links: LinkPrices
    row_bytes: int
    expert_bytes: int

    @classmethod
    def from_cost_model(cls, cost: CostModel, dims: LayerDims, bytes_per_element: int) -> ReplicaPrices:
        """Prices from a calibrated profile, for a layer of ``dims`` in ``bytes_per_element``."""

        def forward(rows: int) -> float:
            return cost.t_ffn(rows, dims.model_dim, dims.hidden_dim, dims.projections)

        row_s = (forward(1001) - forward(1)) / 1000
        return cls(forward(1) - row_s, row_s, LinkPrices.from_cost_model(cost), dims.model_dim * bytes_per_element,
                   dims.expert_parameters * bytes_per_element)

    def compute_seconds(self, plan: Sequence[Sequence[int]], load_E: np.ndarray) -> float:
        """The busiest rank's expert compute (one call per expert it has rows for)."""
        return self._compute(*_held(plan, load_E))

    def exchange_seconds(self, plan: Sequence[Sequence[int]], load_E: np.ndarray) -> float:
        """The rows to the ranks that compute them and back: two exchanges."""
        return self._exchange(*_held(plan, load_E))

    def _compute(self, held_WE: np.ndarray, share_E: np.ndarray) -> float:
        calls = (held_WE & (share_E > 0)).sum(1)
        return float((calls * self.expert_call_s + held_WE @ share_E * self.expert_row_s).max(initial=0.0))

    def _exchange(self, held_WE: np.ndarray, share_E: np.ndarray) -> float:
        world = held_WE.shape[0]
        bytes_WW = np.tile(held_WE @ share_E / world * self.row_bytes, (world, 1))
        np.fill_diagonal(bytes_WW, 0.0)
        return 2 * self.links.exchange_seconds(bytes_WW)

    def copy_may_pay(self, load_E: np.ndarray, storage: Sequence[Sequence[int]], hidden_s: float = 0.0) -> bool:
        """Whether any copy could pay: the cheapest one's seconds beyond ``hidden_s`` against the
        most that copies could save (the busiest rank's compute down to the mean rows' and the
        whole exchange). False lets the planner skip pricing plans that cannot win."""
        held_WE, share_E = _held(storage, load_E)
        floor = float(np.sum(load_E)) * self.expert_row_s / len(storage)
        most_saved = self._compute(held_WE, share_E) - floor + self._exchange(held_WE, share_E)
        link_s = [s for s in (self.links.inter_s_per_byte, self.links.intra_s_per_byte) if s > 0]
        cheapest = self.links.alpha_s + self.expert_bytes * min(link_s, default=0.0)
        return cheapest - hidden_s < most_saved

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
        held = _held(plan, load_E)
        return self._compute(*held) + self._exchange(*held) + copies


@dataclass(frozen=True)
class PlanPrice:
    """One layer's plans priced for one load (a copy's time beyond ``hidden_s``): called on a
    plan, its seconds; :attr:`copies_may_pay` False when no copy can pay (the static plan)."""

    prices: ReplicaPrices
    load_E: np.ndarray
    storage: Sequence[Sequence[int]]
    hidden_s: float = 0.0

    def __call__(self, plan: Sequence[Sequence[int]]) -> float:
        return self.prices.seconds(plan, self.load_E, self.storage, self.hidden_s)

    @property
    def copies_may_pay(self) -> bool:
        return self.prices.copy_may_pay(self.load_E, self.storage, self.hidden_s)


def _held(plan: Sequence[Sequence[int]], load_E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, E) which rank computes which expert, and each copy's share of its expert's load."""
    held_WE = np.zeros((len(plan), len(load_E)), dtype=bool)
    for rank, experts in enumerate(plan):
        held_WE[rank, list(experts)] = True
    return held_WE, np.asarray(load_E, dtype=np.float64) / np.maximum(held_WE.sum(0), 1)
