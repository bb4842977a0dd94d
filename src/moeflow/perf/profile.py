"""Cluster profile: the calibrated alpha-beta fits of one cluster, saved as versioned JSON."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moeflow.perf.alphabeta import AlphaBeta

PROFILE_VERSION = 1
"""The version a saved profile carries; loading one of another version asks to re-run ``moeflow calibrate``."""
SPEED_PROBE = {"tokens": 1024, "model_dim": 512, "hidden_dim": 1024}
"""The reference expert FFN (one expert, forward + backward) a benchmark times beside its settings:
its time over the one the profile's FFN fits predict is how fast the machine ran then, compared
with when it was calibrated (a shared VM's cores drift by tens of percent over minutes)."""
LAYER_PROBE = {"tokens": (64, 128, 256, 512), "model_dim": 64, "hidden_dim": 64, "experts_per_rank": 1, "top_k": 1}
"""The small MoE layer (expert-parallel, no pipelining, linear all-to-all, capacity factor 1) whose
whole call ``moeflow calibrate`` times over these token counts: at this size a call is mostly what
no GEMM or byte count explains (gate, top-k, capacity bookkeeping, the load exchange, Python,
autograd), which the simulated twin takes as a fixed cost per layer call."""

PIPELINE_PROBE = MappingProxyType({"tokens": 1024, "model_dim": 256, "hidden_dim": 1024, "experts_per_rank": 1,
                                   "top_k": 2, "degrees": (1, 2, 4, 8), "compared": 4})
"""The MoE layer ``moeflow calibrate`` times whole (forward and backward) at these pipeline degrees,
x = the degree (the fit is made on 1 and 4, scored on 2 and 8): what chunking that layer gains or
costs on the machine. The twin charges each chunk what the fit's time at the ``compared`` degree,
over degree 1, leaves beyond its own prediction. Its all-to-all and its experts take comparable time
on a CPU cluster, so its degrees differ by what overlap gains there."""

NOT_MEASURED = "not measured: one rank"
""":attr:`ProfileDevice.collectives` of a one-rank profile: no collective fit (the planner prices a
one-rank layer, which moves no bytes)."""


@dataclass(frozen=True)
class ProfileDevice:
    """Where a profile was measured: ``kind`` ``cpu`` or ``cuda``, ``name`` the GPU's model (``cpu``
    on a CPU), ``dtype`` of the compute fits (GEMM, encode/decode, FFN, layer probe), and
    ``collectives`` the backend the collective fits ran over (``gloo``, ``nccl``) or
    :data:`NOT_MEASURED`. A profile saved before this record loads as a CPU one in fp32."""

    kind: str = "cpu"
    name: str = "cpu"
    dtype: str = "fp32"
    collectives: str = "gloo"

    def label(self) -> str:
        return self.name if self.kind == "cpu" else f"{self.kind} ({self.name})"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "dtype": self.dtype, "collectives": self.collectives}

    @classmethod
    def from_dict(cls, values: dict[str, Any] | str | None, world_size: int) -> ProfileDevice:
        """The saved record; ``None`` (a profile from before it): the CPU over gloo, whose
        collectives were measured where the job had more than one rank."""
        collectives = "gloo" if world_size > 1 else NOT_MEASURED
        if values is None:
            return cls(collectives=collectives)
        if isinstance(values, str):  # a hand-written "device": "cpu" or "cuda"
            return cls(kind="cuda" if values.startswith("cuda") else "cpu", name=values, collectives=collectives)
        return cls(kind=str(values.get("kind", "cpu")), name=str(values.get("name", values.get("kind", "cpu"))),
                   dtype=str(values.get("dtype", "fp32")), collectives=str(values.get("collectives", collectives)))


@dataclass(frozen=True)
class ClusterProfile:
    """Fits keyed by operation: ``gemm`` (x = m*k*n), ``alltoall.<algorithm>``,
    ``alltoall.intra_node``, ``alltoall.inter_node``, ``allreduce``, ``allgather``, ``reducescatter``,
    ``allgather.intra_node`` (over one node: Parm's MP group), ``alltoall.saa`` (Parm's S2 combine
    with SAA, x = its all-to-all's bytes) (x = bytes each rank contributes), ``ffn.forward`` and
    ``ffn.backward`` (x = m*M*H*projections), ``layer.forward`` and ``layer.backward`` (one call of
    :data:`LAYER_PROBE`'s layer, x = its tokens per rank), ``encode`` and ``decode`` (forward, x =
    bytes of the routed rows). ``interference`` is the slowdown factor of a GEMM that runs while an
    all-to-all is in flight (>= 1). ``device``: where it was measured (:class:`ProfileDevice`)."""

    nodes: int
    ranks_per_node: int
    fits: dict[str, AlphaBeta]
    interference: float = 1.0
    machine: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)
    device: ProfileDevice = field(default_factory=ProfileDevice)

    def fit(self, name: str) -> AlphaBeta:
        if name not in self.fits:
            raise KeyError(f"profile has no fit for {name!r}; calibrated: {sorted(self.fits)}")
        return self.fits[name]

    def speed_probe_seconds(self) -> float | None:
        """What the FFN fits predict for :data:`SPEED_PROBE` (None without them)."""
        if "ffn.forward" not in self.fits or "ffn.backward" not in self.fits:
            return None
        work = SPEED_PROBE["tokens"] * SPEED_PROBE["model_dim"] * SPEED_PROBE["hidden_dim"] * 2
        return self.fits["ffn.forward"](work) + self.fits["ffn.backward"](work)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
            "fits": {name: fit.to_dict() for name, fit in self.fits.items()},
            "interference": self.interference, "machine": self.machine, "quality": self.quality,
            "device": self.device.to_dict(),
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ClusterProfile:
        if values.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"profile version {values.get('version')!r} is not {PROFILE_VERSION}; re-run moeflow calibrate"
            )
        nodes, ranks_per_node = int(values["nodes"]), int(values["ranks_per_node"])
        return cls(
            nodes=nodes, ranks_per_node=ranks_per_node,
            fits={name: AlphaBeta.from_dict(fit) for name, fit in values["fits"].items()},
            interference=float(values.get("interference", 1.0)), machine=dict(values.get("machine", {})),
            quality=dict(values.get("quality", {})),
            device=ProfileDevice.from_dict(values.get("device"), nodes * ranks_per_node),
        )

    def save(self, path: str | Path) -> None:
        """Atomic write: a temporary file in the same folder, then rename."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            json.dump(self.to_dict(), handle, indent=2)
            temporary = handle.name
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | Path) -> ClusterProfile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no cluster profile at {path}; create one with: moeflow calibrate --out {path}")
        return cls.from_dict(json.loads(path.read_text()))


def median_profile(profiles: list[ClusterProfile]) -> ClusterProfile:
    """One profile from several calibrations of the same cluster: per fit, the median alpha and the
    median beta (over the calibrations that have it), and the median interference. On a small
    shared machine one calibration's slope can be off by 2x; the median of three is not."""
    import statistics

    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    first = profiles[0]
    if any((p.nodes, p.ranks_per_node) != (first.nodes, first.ranks_per_node) for p in profiles):
        raise ValueError("median_profile: the profiles are of different layouts (nodes x ranks per node)")
    if any(p.device != first.device for p in profiles):
        raise ValueError("median_profile: the profiles were measured on different devices or dtypes")
    fits = {}
    for name in dict.fromkeys(n for p in profiles for n in p.fits):
        have = [p.fits[name] for p in profiles if name in p.fits]
        fits[name] = AlphaBeta(statistics.median(f.alpha for f in have), statistics.median(f.beta for f in have),
                               statistics.median(f.r2 for f in have), have[0].unit)
    return ClusterProfile(first.nodes, first.ranks_per_node, fits,
                          statistics.median(p.interference for p in profiles), dict(first.machine),
                          {"median_of": len(profiles)}, first.device)
