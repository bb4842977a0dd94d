"""FasterMoE's dynamic shadowing decision (§4.1): Eq. 7, Eq. 8 and Algorithm 1, on numbers.

Every rank runs :func:`select_shadowed_experts` on the same global routing counts (``T[w][e]``:
tokens rank w routes to expert e, which the layer already all-gathers) and so gets the same set.

Generalised from the paper's one expert per worker to E experts over W ranks:
- a rank's load ``B_w`` is the tokens its un-shadowed experts receive from every rank, plus the
  tokens it routes itself to shadowed experts (those are computed where they are, line 6-8 of
  Algorithm 1); the computation is the slowest rank's (Eq. 1);
- the token exchange is priced per link (Eq. 2): the bytes each rank sends each other rank for
  their un-shadowed experts, summed on every node's network link (each way) and every rank's link
  to its node peers, the busiest link's traffic at that link's calibrated seconds per byte
  (:class:`LinkPrices`); on one rank per node that is the larger of what a rank sends and receives;
- ``latency(S) = max_w compute(B_w) + 4 exchange + max(0, |S| parameter sync - hidden)``: at
  S = {} that is Eq. 7 (forward and backward, 4 all-to-alls); with S it is Eq. 8 plus the tokens
  of the experts that still travel (Eq. 8 drops them: with one expert per worker in the paper, a
  shadowed hot expert leaves little else to send), and minus what moeflow hides of the parameter
  sync: the weights' all-reduce is posted before the exchange and awaited only when the shadowed
  experts compute (the gradients' likewise around the exchanged experts' backward), so it runs
  while the slowest rank computes its exchanged experts' tokens (``hidden``).

Pricing the exchange per link replaced one all-to-all fit on each rank's moved bytes, and the
parameters are priced as the two all-reduces moeflow runs (see :meth:`ShadowPrices.from_cost_model`);
the measurements that decided both are in the docs' record of 2026-11-26 (the topology model).
- candidates are tried hottest first (Algorithm 1's descending sort) and the search stops at the
  first expert that does not lower the latency, as the paper's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.config import EXACT_WIRE, wire_row_bytes
from moeflow.perf.busiest_link import communication_latency
from moeflow.perf.cost import CostModel


@dataclass(frozen=True)
class LinkPrices:
    """Eq. 2's links: seconds per byte on a node's network link (each way) and on a rank's link to
    its node peers, and one all-to-all's fixed latency."""

    ranks_per_node: int
    inter_s_per_byte: float
    intra_s_per_byte: float
    alpha_s: float = 0.0

    @classmethod
    def from_cost_model(cls, cost: CostModel, algorithm: str = "linear") -> LinkPrices:
        """From the all-to-all fits, t = alpha + beta x for x bytes per rank split evenly over the
        W ranks: a node's network link then carries rpn (W - rpn) / W x and a rank's link to its
        peers (rpn - 1) / rpn x, so a link byte costs beta over those shares. The network link
        reads the inter-node fit where calibrated, else the planned algorithm's; the peer link the
        intra-node fit where calibrated, else the same."""
        fits, world, per_node = cost.profile.fits, cost.world_size, cost.profile.ranks_per_node
        planned = fits[f"alltoall.{algorithm}"]
        inter, intra = fits.get("alltoall.inter_node", planned), fits.get("alltoall.intra_node", planned)
        inter_share = per_node * (world - per_node) / world
        intra_share = (per_node - 1) / per_node
        return cls(
            per_node, inter.beta / inter_share if inter_share else 0.0,
            intra.beta / intra_share if intra_share else 0.0, planned.alpha,
        )

    def exchange_seconds(self, bytes_WW: np.ndarray) -> float:
        """One all-to-all-v of ``bytes_WW[s, d]`` bytes from rank s to rank d (0 when nothing moves)."""
        busiest = communication_latency(bytes_WW, self.ranks_per_node, self.inter_s_per_byte, self.intra_s_per_byte)
        return self.alpha_s + busiest if busiest > 0 else 0.0


@dataclass(frozen=True)
class ShadowPrices:
    """What the decision costs things at. ``expert_seconds(rows)``: the forward and backward of the
    expert FFN over ``rows`` tokens on one rank; ``links``: one token exchange, per link (Eq. 2);
    ``parameter_seconds``: broadcasting one expert's parameters from its owner and reducing its
    gradients back (the two collectives of Eq. 8); ``row_bytes``: one token's bytes."""

    expert_seconds: Callable[[float], float]
    links: LinkPrices
    parameter_seconds: float
    row_bytes: int

    @classmethod
    def from_cost_model(
        cls, cost: CostModel, model_dim: int, hidden_dim: int, projections: int, bytes_per_element: int = 4,
        algorithm: str = "linear", wire_dtype: str = EXACT_WIRE,
    ) -> ShadowPrices:
        """Prices from a calibrated profile. moeflow sends a shadowed expert's parameters with one
        all-reduce in the forward (the owner's weights, zeros elsewhere: the broadcast) and one in
        the backward (every rank's gradients summed into the owner's: the reduce), so the pair is
        priced as two all-reduces. (FasterMoE's own broadcast and reduce move what one all-reduce
        moves; pricing them so, the model shadowed a second expert on the emulated 2x2 cluster
        that cost more than it saved.) Token rows cost what ``wire_dtype`` sends; weights travel exact."""
        parameter_bytes = projections * model_dim * hidden_dim * bytes_per_element

        def expert_seconds(rows: float) -> float:
            if rows <= 0:
                return 0.0
            whole = max(1, round(rows))
            return (cost.t_ffn(whole, model_dim, hidden_dim, projections)
                    + cost.t_ffn(whole, model_dim, hidden_dim, projections, backward=True))

        return cls(
            expert_seconds=expert_seconds,
            links=LinkPrices.from_cost_model(cost, algorithm),
            parameter_seconds=2 * cost.t_allreduce(parameter_bytes),
            row_bytes=wire_row_bytes(wire_dtype, model_dim, bytes_per_element),
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


def _compute_load(tokens: np.ndarray, owned_EW: np.ndarray, kept_WE: np.ndarray) -> np.ndarray:
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
    sent_WW = kept_WE @ owned_EW * prices.row_bytes  # bytes rank s sends rank d (the diagonal stays home)
    slowest = max(prices.expert_seconds(float(rows)) for rows in _compute_load(tokens, owned_EW, kept_WE))
    # the weights move while the exchanged experts compute (posted before, awaited after them)
    hidden = max(prices.expert_seconds(float(rows)) for rows in kept_WE.sum(0) @ owned_EW) if shadowed else 0.0
    parameters = max(0.0, len(shadowed) * prices.parameter_seconds - hidden)
    return slowest + 4 * prices.links.exchange_seconds(sent_WW) + parameters


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
