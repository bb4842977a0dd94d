"""The shape of one MoE layer's pipelined region on one rank: what every cost formula (PipeMoE's
recurrence, the schedules' models, the cost model's per-layer times) is a function of. Its own
module so the cost model and the pipeline model can both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.config import EXACT_WIRE, LayerDims, wire_row_bytes
from moeflow.core.capacity import estimated_needed_capacity, expert_capacity


@dataclass(frozen=True)
class RegionShape:
    """The pipelined region of one MoE layer on one rank: an (E, C, M) dispatch buffer of the
    layer's ``dims`` (E experts, FFN of hidden size H) over W ranks. The layer's dimensions stay in
    the one shape type, :class:`moeflow.config.LayerDims`, so every formula reads them by one name."""

    dims: LayerDims
    world_size: int
    capacity: int
    bytes_per_element: int = 4
    tokens: int = 0  # tokens the rank routed (Parm's S1 all-gathers them); 0 when unknown
    needed: int = 0  # the largest per-expert load of any rank (S1 sends occupied slots only); 0 unknown
    wire_dtype: str = EXACT_WIRE  # how the exchanged rows travel (moeflow.comm.wire)

    @classmethod
    def for_tokens(
        cls, dims: LayerDims, tokens: int, capacity_factor: float = 1.0, world_size: int = 1,
        bytes_per_element: int = 4, needed: int | None = None,
    ) -> RegionShape:
        """The region of ``tokens`` tokens per rank at the capacity the layer itself would size
        (:func:`moeflow.core.capacity.expert_capacity`), so a plan for a token count matches the run.
        ``needed`` is the largest per-expert load of the iteration (what f <= 0 sizes the capacity
        from); None assumes the balanced load ceil(k T / E)."""
        load = estimated_needed_capacity(dims.top_k, tokens, dims.num_experts) if needed is None else needed
        capacity = expert_capacity(capacity_factor, dims.top_k, tokens, dims.num_experts, load)
        return cls(dims, world_size, capacity, bytes_per_element, tokens, needed or 0)

    @property
    def row_bytes(self) -> int:
        """Bytes one exchanged row (a token's M values) takes on the link."""
        return wire_row_bytes(self.wire_dtype, self.dims.model_dim, self.bytes_per_element)

    @property
    def occupied(self) -> int:
        """Slots per expert that hold tokens, at most: the capacity, or less when the load is known."""
        return min(self.capacity, self.needed) if self.needed else self.capacity

    @property
    def local_experts(self) -> int:
        return max(1, self.dims.num_experts // self.world_size)

    @property
    def hidden_shards(self) -> int:
        """S = W / E ranks per expert when there are more ranks than experts, else 1."""
        experts = self.dims.num_experts
        return self.world_size // experts if self.world_size > experts else 1
