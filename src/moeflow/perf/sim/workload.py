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

from moeflow.config import DTYPE_BYTES, LayerDims, renamed_settings
from moeflow.core.capacity import expert_capacity
from moeflow.perf.sim.cluster import read_toml_source, shipped_names

DEFAULT_DIMS = LayerDims(1024, 4096, 64, top_k=2, projections=2, bias=False)
"""The simulated layer's default dims: no biases, so an expert's parameters are its projections'
weights (the figures the simulator has always counted)."""
DIM_NAMES = tuple(f.name for f in fields(LayerDims))
RENAMED_KEYS = {"experts": "num_experts"}  # model files' old keys -> the new ones


@dataclass(frozen=True)
class ModelSpec:
    """One MoE transformer. ``tokens_per_rank`` is T (batch x sequence on one rank); every layer
    has attention and an MoE FFN of shape ``dims``. ``capacity_factor`` is Tutel's f (f = 0:
    dropless, the capacity of the busiest expert; compute then runs only real rows)."""

    name: str = "model"
    layers: int = 12
    dims: LayerDims = DEFAULT_DIMS
    capacity_factor: float = 1.0
    tokens_per_rank: int = 4096
    sequence_length: int = 1024
    dtype: str = "fp16"
    routing: str = "uniform"
    vocab_size: int = 0  # > 0: the embedding and LM head count too (a small model's step is not all layers)

    def __post_init__(self) -> None:
        if not isinstance(self.dims, LayerDims):
            raise ValueError(f"model dims must be a LayerDims, got {self.dims!r}")
        for name in ("layers", "tokens_per_rank", "sequence_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise ValueError(f"model vocab_size must be an integer >= 0, got {self.vocab_size!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def dense_parameters(self) -> int:
        """Parameters of one layer every rank holds and all-reduces: attention and the gate."""
        model_dim = self.dims.model_dim
        return 4 * model_dim**2 + model_dim * self.dims.num_experts

    def with_overrides(self, **values: Any) -> ModelSpec:
        """This model with the given settings changed, by their flat names (a layer dim such as
        ``num_experts`` goes into ``dims``); None leaves a setting as it is, so CLI flags pass through."""
        values = {k: v for k, v in values.items() if v is not None}
        dims = {k: values.pop(k) for k in DIM_NAMES if k in values}
        unknown = sorted(set(values) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"unknown model setting(s) {', '.join(unknown)}; known: {', '.join(flat_settings())}")
        if dims:
            values["dims"] = _dims(values.get("dims", self.dims), dims)
        return replace(self, **values)


def flat_settings() -> list[str]:
    """The settings a model file or :meth:`ModelSpec.with_overrides` takes: the layer dims flat."""
    return sorted({f.name for f in fields(ModelSpec)} - {"dims"} | set(DIM_NAMES))


def _dims(base: LayerDims, values: dict[str, Any]) -> LayerDims:
    """``base`` with ``values`` changed; its errors name the setting as a model's own do."""
    try:
        return replace(base, **values)
    except ValueError as error:
        raise ValueError(f"model {error}") from None


def named_models() -> list[str]:
    """The model files shipped with moeflow (the papers' models), by name."""
    return shipped_names("models")


def load_model(name_or_path: str | Path | None) -> ModelSpec:
    """A shipped model by name, a TOML file by path, or (None) the defaults of :class:`ModelSpec`."""
    if name_or_path is None:
        return ModelSpec()
    return model_from_toml(*read_toml_source(name_or_path, "models", "model"))


def model_from_toml(text: str, origin: str = "<string>") -> ModelSpec:
    """A model file: the flat settings (:func:`flat_settings`) at top level or under ``[model]``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"model file {origin}: not valid TOML ({error})") from None
    data = renamed_settings(data.get("model", data), RENAMED_KEYS, f"model file {origin}")
    data.setdefault("name", Path(origin).stem)
    known = flat_settings()
    unknown = sorted(set(data) - set(known) - {"description", "sources"})
    if unknown:
        raise ValueError(f"model file {origin}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    dims = {k: v for k, v in data.items() if k in DIM_NAMES}
    try:
        return ModelSpec(**{k: v for k, v in data.items() if k in known and k not in dims},
                         dims=_dims(DEFAULT_DIMS, dims))
    except (TypeError, ValueError) as error:
        raise ValueError(f"model file {origin}: {error}") from None


@dataclass(frozen=True)
class LayerLoad:
    """One layer's routing on the cluster: ``counts[s, e]`` tokens rank s routes to expert e (or,
    over EPLB's slots, to slot e of expert ``experts[e]`` on rank ``owners[e]``)."""

    counts: np.ndarray
    experts: np.ndarray | None = None  # the expert id of each column (None: 0..E-1)
    owners: np.ndarray | None = None  # the rank computing each column (None: expert parallelism's)

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
        dims = model.dims
        return expert_capacity(model.capacity_factor, dims.top_k, model.tokens_per_rank, dims.num_experts, needed)

    def dropped(self, model: ModelSpec) -> float:
        """Assignments beyond capacity (Tutel drops them; the simulator counts them)."""
        return float(np.maximum(self.counts - self.capacity(model), 0.0).sum())


def routing_loads(model: ModelSpec, world: int, seed: int = 0) -> list[LayerLoad]:
    """The (W, E) load of every layer for ``model.routing`` on ``world`` ranks."""
    routing, num_experts = model.routing, model.dims.num_experts
    assignments = model.dims.top_k * model.tokens_per_rank
    if routing in ("uniform", "one-hot") or routing.startswith("zipf:"):
        shares = _named_shares(routing, num_experts)
        rng = np.random.default_rng(seed)
        loads = []
        for layer in range(model.layers):
            order = np.arange(num_experts) if layer == 0 or routing == "uniform" else rng.permutation(num_experts)
            row = np.empty(num_experts)
            row[order] = shares * assignments
            loads.append(LayerLoad(np.broadcast_to(row, (world, num_experts))))
        return loads
    return _trace_loads(Path(routing), model, world)


def _named_shares(routing: str, num_experts: int) -> np.ndarray:
    try:
        return skew_shares(routing, num_experts)
    except ValueError as error:
        raise ValueError(f"model routing: {error}") from None


def skew_shares(skew: str, num_experts: int, probabilities: Sequence[float] = ()) -> np.ndarray:
    """The share of assignments each expert gets under a named skew ("uniform", "zipf:<s>",
    "one-hot") or recorded ``probabilities``, hottest first (expert 0)."""
    if probabilities:
        weights = np.asarray(probabilities, dtype=np.float64)
    elif skew == "uniform":
        weights = np.ones(num_experts)
    elif skew == "one-hot":
        weights = np.eye(num_experts)[0]
    elif skew.startswith("zipf:"):
        weights = 1.0 / np.arange(1, num_experts + 1) ** float(skew.removeprefix("zipf:"))
    else:
        raise ValueError(f"unknown skew {skew!r}; use uniform, zipf:<s>, one-hot or recorded probabilities")
    if weights.shape != (num_experts,) or weights.min() < 0 or weights.sum() <= 0:
        raise ValueError(f"skew {skew!r}: need {num_experts} non-negative shares, got {weights.tolist()}")
    return weights / weights.sum()


def _trace_loads(path: Path, model: ModelSpec, world: int) -> list[LayerLoad]:
    if not path.is_file():
        raise ValueError(
            f"model routing {str(path)!r} is neither uniform, zipf:<s>, one-hot nor a trace file (.npy or .json)"
        )
    trace = np.load(path) if path.suffix == ".npy" else np.asarray(json.loads(path.read_text()), dtype=np.float64)
    num_experts = model.dims.num_experts
    if trace.shape[-1] != num_experts or trace.ndim > 3:
        raise ValueError(f"routing trace {path}: shape {trace.shape} must end in the {num_experts} experts")
    if trace.ndim == 3 and trace.shape[1] != world:
        raise ValueError(f"routing trace {path}: {trace.shape[1]} ranks recorded, simulating {world}")
    trace = trace.reshape((-1, *trace.shape[-2 if trace.ndim == 3 else -1:]))
    assignments = model.dims.top_k * model.tokens_per_rank
    loads = []
    for layer in range(model.layers):
        counts = np.asarray(trace[layer % trace.shape[0]], dtype=np.float64)
        shares = counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1e-12)
        loads.append(LayerLoad(np.broadcast_to(shares * assignments, (world, num_experts))))
    return loads
