"""Lina's token paths (§5.2): which experts the tokens that took a path of experts pick next.

A token's path at MoE layer i is the expert it ranked first at each of the layers before i. The
profile holds, for every layer i and every path length j = 0 .. min(l, i) (j = 0: no path, the
layer's own popularity), how often the tokens that took each path selected each expert of layer i
(all k choices) and how many tokens took it. A path seen by too few tokens falls back to its
shorter suffix. Estimating a batch's popularity (Eq. 1) takes, for each token, its path's
distribution, keeps that distribution's top-k experts and sums over the tokens.

Stored beside the checkpoint as safetensors (paths as integer keys: the experts are the digits
of a base-E number, oldest first), with a fingerprint of the routers it was recorded with.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

PATH_LENGTH = 3
"""Lina's default path length l: how many earlier layers' choices a token's path holds."""
MIN_PATH_TOKENS = 4  # a path seen by fewer profiled tokens falls back to a shorter one
PROFILE_FILE = "routing_profile.safetensors"
"""The file name ``moeflow profile-routing`` saves a routing profile under, beside the model."""


def routing_fingerprint(gates: Sequence[nn.Module]) -> str:
    """A hash of the routers' weights (in bfloat16, so a model loaded in another dtype matches)."""
    digest = hashlib.sha256()
    for gate in gates:
        for name, tensor in sorted(gate.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def path_keys(history_TJ: np.ndarray, num_experts: int) -> np.ndarray:
    """Integer keys of the rows of a (T, j) path matrix (oldest expert first)."""
    keys = np.zeros(history_TJ.shape[0], dtype=np.int64)
    for column in range(history_TJ.shape[1]):
        keys = keys * num_experts + history_TJ[:, column]
    return keys


@dataclass(frozen=True)
class PathTable:
    """The paths of one length ending before one layer: sorted keys, selections per expert, tokens."""

    keys: np.ndarray  # (P,) int64, ascending
    counts: np.ndarray  # (P, E) int64
    tokens: np.ndarray  # (P,) int64

    @classmethod
    def of(cls, keys_T: np.ndarray, choices_TK: np.ndarray, num_experts: int) -> PathTable:
        unique, inverse, tokens = np.unique(keys_T, return_inverse=True, return_counts=True)
        counts = np.zeros((len(unique), num_experts), dtype=np.int64)
        np.add.at(counts, (np.repeat(inverse, choices_TK.shape[1]), choices_TK.reshape(-1)), 1)
        return cls(unique.astype(np.int64), counts, tokens.astype(np.int64))


@dataclass(frozen=True)
class RoutingProfile:
    """The path tables of every MoE layer (``tables[i][j]``: paths of length j before layer i)."""

    num_experts: int
    top_k: int
    path_length: int
    fingerprint: str
    tokens: int
    tables: tuple[tuple[PathTable, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.tables)

    @classmethod
    def from_routes(
        cls, routes_TLK: np.ndarray, num_experts: int, fingerprint: str, path_length: int = PATH_LENGTH
    ) -> RoutingProfile:
        """From every profiled token's choices at every MoE layer, (T, layers, k), first choice first."""
        if routes_TLK.ndim != 3 or routes_TLK.shape[0] == 0:
            raise ValueError("a routing profile needs the choices of at least one token, shaped (tokens, layers, k)")
        if path_length < 1:
            raise ValueError(f"path_length must be >= 1, got {path_length}")
        first_TL = routes_TLK[:, :, 0].astype(np.int64)
        tables = tuple(
            tuple(PathTable.of(path_keys(first_TL[:, layer - j: layer], num_experts), routes_TLK[:, layer], num_experts)
                  for j in range(min(path_length, layer) + 1))
            for layer in range(routes_TLK.shape[1])
        )
        return cls(num_experts, routes_TLK.shape[2], path_length, fingerprint, routes_TLK.shape[0], tables)

    def estimate(self, layer: int, history_TI: np.ndarray, top_k: int, min_tokens: int = MIN_PATH_TOKENS,
                 path_length: int | None = None) -> np.ndarray:
        """Eq. 1: the expected selections of each expert at ``layer`` by tokens whose first choices
        at the layers before it are ``history_TI`` (T, layer), from each path's top-k experts."""
        longest = min(self.path_length if path_length is None else path_length, layer)
        load = np.zeros(self.num_experts)
        unresolved = np.ones(history_TI.shape[0], dtype=bool)
        for j in range(longest, -1, -1):
            if not unresolved.any():
                break
            table = self.tables[layer][j]
            keys = path_keys(history_TI[unresolved, layer - j: layer], self.num_experts)
            at = np.minimum(np.searchsorted(table.keys, keys), len(table.keys) - 1)
            known = (table.keys[at] == keys) & ((table.tokens[at] >= min_tokens) | (j == 0))
            rows, weight = np.unique(at[known], return_counts=True)
            distribution = table.counts[rows] / table.tokens[rows, None]
            cut = np.sort(distribution, axis=1)[:, -top_k][:, None] if len(rows) else 0.0
            load += (np.where(distribution >= cut, distribution, 0.0) * weight[:, None]).sum(axis=0)
            unresolved[np.flatnonzero(unresolved)[known]] = False
        return load

    # -- the file ---------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        arrays = {f"layer{i}.length{j}.{field}": getattr(table, field)
                  for i, layer in enumerate(self.tables) for j, table in enumerate(layer)
                  for field in ("keys", "counts", "tokens")}
        meta = {"num_experts": self.num_experts, "top_k": self.top_k, "path_length": self.path_length,
                "fingerprint": self.fingerprint, "tokens": self.tokens, "num_layers": self.num_layers}
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        save_file(arrays, str(partial), metadata={"moeflow_routing_profile": json.dumps(meta)})
        partial.replace(target)

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        from safetensors import safe_open

        if not Path(path).is_file():
            raise FileNotFoundError(
                f"no routing profile at {str(path)!r}; record one with moeflow profile-routing --checkpoint DIR "
                "(or --hf DIR --corpus FILE)"
            )
        with safe_open(str(path), framework="numpy") as file:
            raw = (file.metadata() or {}).get("moeflow_routing_profile")
            if raw is None:
                raise ValueError(f"{str(path)!r} is not a moeflow routing profile (its metadata has no profile)")
            meta = json.loads(raw)
            tables = tuple(
                tuple(PathTable(*(file.get_tensor(f"layer{i}.length{j}.{f}") for f in ("keys", "counts", "tokens")))
                      for j in range(min(meta["path_length"], i) + 1))
                for i in range(meta["num_layers"])
            )
        return cls(meta["num_experts"], meta["top_k"], meta["path_length"], meta["fingerprint"], meta["tokens"], tables)

    def check_matches(self, num_layers: int, num_experts: int, fingerprint: str, source: str) -> None:
        """A clear error when this profile was recorded on another model than the one it schedules."""
        problems = [f"{name} {mine} vs the model's {theirs}" for name, mine, theirs in (
            ("MoE layers", self.num_layers, num_layers), ("experts", self.num_experts, num_experts),
            ("router fingerprint", self.fingerprint, fingerprint)) if mine != theirs]
        if problems:
            raise ValueError(
                f"the routing profile {source!r} was recorded on another model ({'; '.join(problems)}); record it "
                "again for this model with moeflow profile-routing"
            )
