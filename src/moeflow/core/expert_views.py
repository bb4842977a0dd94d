"""Each expert's weights as views made once per storage, for the loops that run one expert at a time.

A decode forward on a CPU runs each chosen expert on its few rows, one after the other. Indexing
the (L, ...) parameters anew for each (three ``select`` ops an expert, SwiGLU's w1, w3 and w2) cost
about 0.1 ms of a one-token forward over 8 of 64 experts with a cold cache, 7 % of it. The views
are made again when a weight is replaced or moves (its identity, storage or shape changes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ExpertWeights = tuple[torch.Tensor | None, ...]
"""One expert's (w1, b1, w2, b2, w3, b3), as :meth:`moeflow.core.experts.FFNWeights.as_tuple` orders them."""


class ExpertViews:
    """The views of one set of expert weights, per expert; empty until first asked, and again when
    the weights change. Copies and pickles start empty (the views belong to the original's tensors)."""

    __slots__ = ("_key", "_views")

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._views: list[ExpertWeights] = []

    def of(self, weights: ExpertWeights) -> Sequence[ExpertWeights]:
        """Expert e's weights at ``[e]`` (each a view of ``weights``' tensors, made without autograd)."""
        key = tuple(None if w is None else (id(w), w.data_ptr(), w.shape) for w in weights)
        if key != self._key:
            with torch.no_grad():
                unbound = [None if w is None else w.unbind(0) for w in weights]
            self._views = [tuple(None if u is None else u[e] for u in unbound) for e in range(weights[0].shape[0])]
            self._key = key
        return self._views

    def clear(self) -> None:
        """Let go of the views (and the storage they keep): the weights were replaced."""
        self._key, self._views = None, []

    def __deepcopy__(self, memo: dict[int, object]) -> ExpertViews:
        return ExpertViews()

    def __getstate__(self) -> None:
        return None

    def __setstate__(self, state: None) -> None:
        self.__init__()
