"""Cost functions on a calibrated profile: what PipeMoE's and Tutel's planners evaluate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moeflow.perf.profile import ClusterProfile

if TYPE_CHECKING:  # perf.pipeline builds on this module
    from moeflow.perf.shape import RegionShape


class CostModel:
    """t_gemm, t_expert, t_a2a (per algorithm), t_allreduce, t_allgather in seconds."""

    def __init__(self, profile: ClusterProfile) -> None:
        self.profile = profile

    @property
    def world_size(self) -> int:
        return self.profile.nodes * self.profile.ranks_per_node

    def t_gemm(self, m: int, k: int, n: int) -> float:
        return self.profile.fit("gemm")(m * k * n)

    def t_ffn(self, rows: int, model_dim: int, hidden_dim: int, projections: int, backward: bool = False) -> float:
        """One expert FFN (or hidden shard) on ``rows`` tokens, forward or backward. With the
        calibrated ``ffn.forward`` / ``ffn.backward`` fits (the whole FFN timed: GEMMs, bias,
        activation, and the backward's input and weight gradients) it is those at x = rows * M * H *
        projections; without them, projections GEMMs forward and twice that backward."""
        work = rows * model_dim * hidden_dim * projections
        fit = f"ffn.{'backward' if backward else 'forward'}"
        if fit in self.profile.fits:
            return self.profile.fit(fit)(work)
        return (2 if backward else 1) * projections * self.t_gemm(rows, model_dim, hidden_dim)

    def t_expert(self, shape: RegionShape, backward: bool = False, overlapped: bool = False) -> float:
        """Expert FFN of the local experts on the dispatched (E_local, W*C, M) buffer, over this
        profile's W ranks (the unpipelined whole-layer estimate of ``moeflow plan``)."""
        layer = shape.dims
        local_experts = max(1, layer.num_experts // self.world_size)
        rows = self.world_size * shape.capacity
        dims = (rows, layer.model_dim, layer.hidden_dim, layer.projections)
        seconds = local_experts * (self.t_ffn(*dims) + (self.t_ffn(*dims, backward=True) if backward else 0.0))
        return seconds * (self.profile.interference if overlapped else 1.0)

    def dispatch_bytes(self, shape: RegionShape) -> int:
        """Bytes one rank sends in one all-to-all: its whole (E, C, M) buffer."""
        return shape.dims.num_experts * shape.capacity * shape.row_bytes

    def t_alltoall(self, algorithm: str, size_bytes: float) -> float:
        if self.world_size == 1:
            return 0.0
        return self.profile.fit(f"alltoall.{algorithm}")(size_bytes)

    def t_allreduce(self, size_bytes: float) -> float:
        return 0.0 if self.world_size == 1 else self.profile.fit("allreduce")(size_bytes)

    def t_allgather(self, size_bytes: float, group_size: int | None = None, intra_node: bool = False) -> float:
        """All-gather of ``size_bytes`` per rank (its input) over ``group_size`` ranks (the world
        by default). A smaller group is priced as the fit at the same received volume, (g - 1) * x:
        ring collectives move that much whatever the group. ``intra_node``: the group lies inside
        one node (Parm's MP group), priced from the ``allgather.intra_node`` fit when calibrated."""
        group = self.world_size if group_size is None else group_size
        if group <= 1 or self.world_size == 1:
            return 0.0
        per_node = self.profile.ranks_per_node
        if intra_node and per_node > 1 and "allgather.intra_node" in self.profile.fits:
            return self.profile.fit("allgather.intra_node")(size_bytes * (group - 1) / (per_node - 1))
        return self.profile.fit("allgather")(size_bytes * (group - 1) / (self.world_size - 1))

    def remote_token_share(self) -> float | None:
        """FasterMoE's topology-aware gate limit L / B = W_net / (M W_local) (§4.3), from the
        all-to-all fits inside one node and across nodes (bandwidth = 1 / beta); None when the
        profile lacks either (one rank per node has no intra-node fit)."""
        fits = self.profile.fits
        if "alltoall.intra_node" not in fits or "alltoall.inter_node" not in fits:
            return None
        net, local = fits["alltoall.inter_node"].beta, fits["alltoall.intra_node"].beta
        return min(1.0, local / (self.profile.ranks_per_node * net)) if net > 0 else 1.0

    def t_saa(self, size_bytes: float, mp_size: int) -> float:
        """Parm's SAA: an all-to-all of ``size_bytes`` per rank over the world overlapped with the
        all-gather of what it returns over an intra-node MP group of ``mp_size`` ranks (one op,
        fitted whole as Parm §V-A's alpha_o + beta_o x, at the calibrated N_MP = ranks per node;
        uncalibrated: the two in series)."""
        per_node = self.profile.ranks_per_node
        if "alltoall.saa" in self.profile.fits and mp_size == per_node:
            return self.profile.fit("alltoall.saa")(size_bytes)
        returned = size_bytes / max(1, mp_size)  # the ESP sum leaves 1 / N_ESP of the partials
        return self.t_alltoall("linear", size_bytes) + self.t_allgather(returned, mp_size, intra_node=True)

    def t_reducescatter(self, size_bytes: float, group_size: int | None = None) -> float:
        """Reduce-scatter of ``size_bytes`` per rank (its full input) over ``group_size`` ranks,
        scaled to a smaller group by the received volume (g - 1) / g * x, as :meth:`t_allgather`."""
        group = self.world_size if group_size is None else group_size
        if group <= 1 or self.world_size == 1:
            return 0.0
        world = self.world_size
        return self.profile.fit("reducescatter")(size_bytes * (group - 1) / group * world / (world - 1))

    def layer_times(self, shape: RegionShape, algorithm: str = "linear", backward: bool = True) -> dict[str, float]:
        """Unpipelined forward(+backward) prediction: two all-to-alls per pass around the experts."""
        passes = 2 if backward else 1
        communicate = 2 * passes * self.t_alltoall(algorithm, self.dispatch_bytes(shape))
        compute = self.t_expert(shape, backward=backward)
        return {"compute_s": compute, "communicate_s": communicate, "serial_s": compute + communicate}
