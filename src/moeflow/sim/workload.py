"""The simulated model: an MoE transformer's shapes (from TOML or arguments) and its routing load.

Routing is a per-layer (W, E) matrix of tokens each rank sends each expert: ``uniform``, a Zipf
skew ``zipf:<s>`` (expected counts, the hot expert moved per layer), ``one-hot``, or a recorded
trace (.npy or .json of shape (E,), (layers, E) or (layers, W, E): shares or counts per expert).
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from moeflow.capacity import expert_capacity
from moeflow.config import DTYPE_BYTES
from moeflow.sim.cluster import read_toml_source, shipped_names


@dataclass(frozen=True)
class ModelSpec:
    """One MoE transformer. ``tokens_per_rank`` is T (batch x sequence on one rank); every layer
    has attention and an MoE FFN. ``capacity_factor`` is Tutel's f (f = 0: dropless, the capacity
    of the busiest expert; compute then runs only real rows)."""

    name: str = "model"
    layers: int = 12
    model_dim: int = 1024
    hidden_dim: int = 4096
    experts: int = 64
    top_k: int = 2
    capacity_factor: float = 1.0
    tokens_per_rank: int = 4096
    sequence_length: int = 1024
    projections: int = 2
    dtype: str = "fp16"
    routing: str = "uniform"
    vocab_size: int = 0  # > 0: the embedding and LM head count too (a small model's step is not all layers)

    def __post_init__(self) -> None:
        for name in ("layers", "model_dim", "hidden_dim", "experts", "top_k", "tokens_per_rank",
                     "sequence_length", "projections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise ValueError(f"model vocab_size must be an integer >= 0, got {self.vocab_size!r}")
        if self.top_k > self.experts:
            raise ValueError(f"model top_k ({self.top_k}) must be <= experts ({self.experts})")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def dense_parameters(self) -> int:
        """Parameters of one layer every rank holds and all-reduces: attention and the gate."""
        return 4 * self.model_dim**2 + self.model_dim * self.experts

    def expert_parameters(self) -> int:
        return self.model_dim * self.hidden_dim * self.projections

    def with_overrides(self, **values: Any) -> ModelSpec:
        return replace(self, **{k: v for k, v in values.items() if v is not None})


def named_models() -> list[str]:
    """The model files shipped with moeflow (the papers' models), by name."""
    return shipped_names("models")


def load_model(name_or_path: str | Path | None) -> ModelSpec:
    """A shipped model by name, a TOML file by path, or (None) the defaults of :class:`ModelSpec`."""
    if name_or_path is None:
        return ModelSpec()
    return model_from_toml(*read_toml_source(name_or_path, "models", "model"))


def model_from_toml(text: str, origin: str = "<string>") -> ModelSpec:
    """A model file: the :class:`ModelSpec` fields at top level or under ``[model]``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"model file {origin}: not valid TOML ({error})") from None
    data = data.get("model", data)
    data.setdefault("name", Path(origin).stem)
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - known - {"description", "sources"})
    if unknown:
        raise ValueError(
            f"model file {origin}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return ModelSpec(**{k: v for k, v in data.items() if k in known})
    except (TypeError, ValueError) as error:
        raise ValueError(f"model file {origin}: {error}") from None


@dataclass(frozen=True)
class LayerLoad:
    """One layer's routing on the cluster: ``counts[s, e]`` tokens rank s routes to expert e."""

    counts: np.ndarray
    experts: np.ndarray | None = None  # the expert id of each column (None: 0..E-1)

    def __post_init__(self) -> None:
        if self.experts is None:
            object.__setattr__(self, "experts", np.arange(self.counts.shape[1]))

    def without(self, hot: np.ndarray) -> LayerLoad:
        """The load of the experts that still travel once ``hot`` are shadowed."""
        keep = np.setdiff1d(np.arange(self.counts.shape[1]), hot)
        return LayerLoad(self.counts[:, keep], self.experts[keep])

    def with_shadowed_slots(self, hot: np.ndarray) -> LayerLoad:
        """What travels when the shadowed ``hot`` experts keep their slots in an equal-split
        exchange, cut to the capacity the others need (moeflow's shadowing): every column, the hot
        ones at most the others' largest count."""
        keep = np.setdiff1d(np.arange(self.counts.shape[1]), hot)
        counts = self.counts.copy()
        counts[:, hot] = np.minimum(counts[:, hot], self.counts[:, keep].max(initial=0.0))
        return LayerLoad(counts, self.experts)

    def capacity(self, model: ModelSpec) -> int:
        needed = math.ceil(float(self.counts.max()))
        return expert_capacity(model.capacity_factor, model.top_k, model.tokens_per_rank, model.experts, needed)

    def dropped(self, model: ModelSpec) -> float:
        """Assignments beyond capacity (Tutel drops them; the simulator counts them)."""
        return float(np.maximum(self.counts - self.capacity(model), 0.0).sum())


def routing_loads(model: ModelSpec, world: int, seed: int = 0) -> list[LayerLoad]:
    """The (W, E) load of every layer for ``model.routing`` on ``world`` ranks."""
    routing = model.routing
    assignments = model.top_k * model.tokens_per_rank
    if routing in ("uniform", "one-hot") or routing.startswith("zipf:"):
        shares = _named_shares(routing, model.experts)
        rng = np.random.default_rng(seed)
        loads = []
        for layer in range(model.layers):
            order = np.arange(model.experts) if layer == 0 or routing == "uniform" else rng.permutation(model.experts)
            row = np.empty(model.experts)
            row[order] = shares * assignments
            loads.append(LayerLoad(np.broadcast_to(row, (world, model.experts))))
        return loads
    return _trace_loads(Path(routing), model, world)


def _named_shares(routing: str, experts: int) -> np.ndarray:
    try:
        return skew_shares(routing, experts)
    except ValueError as error:
        raise ValueError(f"model routing: {error}") from None


def skew_shares(skew: str, experts: int, probabilities: Sequence[float] = ()) -> np.ndarray:
    """The share of assignments each expert gets under a named skew ("uniform", "zipf:<s>",
    "one-hot") or recorded ``probabilities``, hottest first (expert 0)."""
    if probabilities:
        weights = np.asarray(probabilities, dtype=np.float64)
    elif skew == "uniform":
        weights = np.ones(experts)
    elif skew == "one-hot":
        weights = np.eye(experts)[0]
    elif skew.startswith("zipf:"):
        weights = 1.0 / np.arange(1, experts + 1) ** float(skew.removeprefix("zipf:"))
    else:
        raise ValueError(f"unknown skew {skew!r}; use uniform, zipf:<s>, one-hot or recorded probabilities")
    if weights.shape != (experts,) or weights.min() < 0 or weights.sum() <= 0:
        raise ValueError(f"skew {skew!r}: need {experts} non-negative shares, got {weights.tolist()}")
    return weights / weights.sum()


def _trace_loads(path: Path, model: ModelSpec, world: int) -> list[LayerLoad]:
    if not path.is_file():
        raise ValueError(
            f"model routing {str(path)!r} is neither uniform, zipf:<s>, one-hot nor a trace file (.npy or .json)"
        )
    trace = np.load(path) if path.suffix == ".npy" else np.asarray(json.loads(path.read_text()), dtype=np.float64)
    if trace.shape[-1] != model.experts or trace.ndim > 3:
        raise ValueError(f"routing trace {path}: shape {trace.shape} must end in the {model.experts} experts")
    if trace.ndim == 3 and trace.shape[1] != world:
        raise ValueError(f"routing trace {path}: {trace.shape[1]} ranks recorded, simulating {world}")
    trace = trace.reshape((-1, *trace.shape[-2 if trace.ndim == 3 else -1:]))
    assignments = model.top_k * model.tokens_per_rank
    loads = []
    for layer in range(model.layers):
        counts = np.asarray(trace[layer % trace.shape[0]], dtype=np.float64)
        shares = counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1e-12)
        loads.append(LayerLoad(np.broadcast_to(shares * assignments, (world, model.experts))))
    return loads
