"""FasterMoE's dynamic shadowing decision (§4.1): Eq. 7, Eq. 8 and Algorithm 1, on numbers.

Every rank runs :func:`select_shadowed_experts` on the same global routing counts (``T[w][e]``:
tokens rank w routes to expert e, which the layer already all-gathers) and so gets the same set.

Generalised from the paper's one expert per worker to E experts over W ranks:
- a rank's load ``B_w`` is the tokens its un-shadowed experts receive from every rank, plus the
  tokens it routes itself to shadowed experts (those are computed where they are, line 6-8 of
  Algorithm 1);
- the token exchange of a rank is the larger of what it sends to and receives from other ranks'
  un-shadowed experts (Eq. 2's busiest link, with one link per rank);
- ``latency(S) = max_w (compute(B_w) + 4 exchange_w) + |S| parameter sync``: at S = {} that is
  Eq. 7 (forward and backward, 4 all-to-alls); with S it is Eq. 8 plus the tokens of the experts
  that still travel (Eq. 8 drops them: with one expert per worker in the paper, a shadowed hot
  expert leaves little else to send).
- candidates are tried hottest first (Algorithm 1's descending sort) and the search stops at the
  first expert that does not lower the latency, as the paper's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.perf.cost import CostModel


@dataclass(frozen=True)
class ShadowPrices:
    """What the decision costs things at. ``expert_seconds(rows)``: the forward and backward of the
    expert FFN over ``rows`` tokens on one rank; ``exchange_seconds(bytes)``: one all-to-all in
    which a rank moves ``bytes``; ``parameter_seconds``: broadcasting one expert's parameters from
    its owner and reducing its gradients back (the two collectives of Eq. 8)."""

    expert_seconds: Callable[[float], float]
    exchange_seconds: Callable[[float], float]
    parameter_seconds: float
    row_bytes: int

    @classmethod
    def from_cost_model(
        cls, cost: CostModel, model_dim: int, hidden_dim: int, projections: int, bytes_per_element: int = 4,
        algorithm: str = "linear",
    ) -> ShadowPrices:
        """Prices from a calibrated profile. The broadcast + reduce pair moves what one ring
        all-reduce of the parameters moves (a reduce-scatter and an all-gather), so it is priced
        as that all-reduce."""
        parameter_bytes = projections * model_dim * hidden_dim * bytes_per_element

        def expert_seconds(rows: float) -> float:
            if rows <= 0:
                return 0.0
            whole = max(1, round(rows))
            return (cost.t_ffn(whole, model_dim, hidden_dim, projections)
                    + cost.t_ffn(whole, model_dim, hidden_dim, projections, backward=True))

        return cls(
            expert_seconds=expert_seconds,
            exchange_seconds=lambda size: cost.t_alltoall(algorithm, size) if size > 0 else 0.0,
            parameter_seconds=cost.t_allreduce(parameter_bytes),
            row_bytes=model_dim * bytes_per_element,
        )


@dataclass(frozen=True)
class ShadowDecision:
    """The experts to shadow this iteration and the predicted step latencies without and with."""

    experts: tuple[int, ...]
    latency_without_s: float
    latency_with_s: float

    @property
    def predicted_gain_s(self) -> float:
        return self.latency_without_s - self.latency_with_s


def rank_compute_load(
    tokens_WE: Sequence[Sequence[int]] | np.ndarray, owner_E: Sequence[int], shadowed: set[int]
) -> np.ndarray:
    """B_w per rank: the tokens of its un-shadowed experts from every rank, plus its own tokens of
    the shadowed experts (computed where they are)."""
    tokens = np.asarray(tokens_WE, dtype=np.float64)
    owned_EW, kept_WE = _kept_tokens(tokens, owner_E, shadowed)
    return kept_WE.sum(0) @ owned_EW + (tokens - kept_WE).sum(1)


def _kept_tokens(
    tokens: np.ndarray, owner_E: Sequence[int], shadowed: set[int]
) -> tuple[np.ndarray, np.ndarray]:
    """The (E, W) one-hot owner matrix and the (W, E) tokens of the experts not shadowed."""
    ranks, experts = tokens.shape
    owned_EW = np.zeros((experts, ranks))
    owned_EW[np.arange(experts), np.asarray(owner_E)] = 1.0
    kept_E = np.ones(experts)
    kept_E[list(shadowed)] = 0.0
    return owned_EW, tokens * kept_E


def shadowed_latency(
    tokens_WE: Sequence[Sequence[int]] | np.ndarray, owner_E: Sequence[int], shadowed: set[int], prices: ShadowPrices
) -> float:
    """Predicted forward + backward latency of the layer when ``shadowed`` experts are computed
    where their tokens are (Eq. 7 for none, Eq. 8 generalised otherwise). Vectorised over ranks
    and experts: Algorithm 1 calls it once per candidate, every iteration."""
    tokens = np.asarray(tokens_WE, dtype=np.float64)
    owned_EW, kept_WE = _kept_tokens(tokens, owner_E, shadowed)
    own_kept_W = (kept_WE * owned_EW.T).sum(1)  # tokens a rank routes to its own kept experts
    arriving_W = kept_WE.sum(0) @ owned_EW  # all tokens of a rank's kept experts
    compute_W = rank_compute_load(tokens, owner_E, shadowed)
    moved_W = np.maximum(kept_WE.sum(1) - own_kept_W, arriving_W - own_kept_W)
    slowest = max(
        prices.expert_seconds(float(compute)) + 4 * prices.exchange_seconds(float(moved) * prices.row_bytes)
        for compute, moved in zip(compute_W, moved_W, strict=True)
    )
    return slowest + len(shadowed) * prices.parameter_seconds


def select_shadowed_experts(
    tokens_WE: Sequence[Sequence[int]] | np.ndarray, owner_E: Sequence[int], prices: ShadowPrices,
    limit: int | None = None,
) -> ShadowDecision:
    """Algorithm 1: add the hottest experts one by one while the predicted latency falls; stop at
    the first that does not help (or after ``limit`` experts)."""
    num_experts = len(owner_E)
    tokens = np.asarray(tokens_WE, dtype=np.float64)
    if tokens.ndim != 2 or tokens.shape[1] != num_experts:
        raise ValueError(f"tokens_WE must be (ranks, experts) with one column per expert ({num_experts}); "
                         f"got shape {tokens.shape}")
    load_E = tokens.sum(0).tolist()
    best = baseline = shadowed_latency(tokens, owner_E, set(), prices)
    chosen: list[int] = []
    for expert in sorted(range(num_experts), key=lambda e: (-load_E[e], e)):
        if (limit is not None and len(chosen) >= limit) or not load_E[expert]:
            break
        latency = shadowed_latency(tokens, owner_E, {*chosen, expert}, prices)
        if latency >= best:
            break
        best = latency
        chosen.append(expert)
    return ShadowDecision(tuple(chosen), baseline, best)
