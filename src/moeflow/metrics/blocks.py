"""The MoE blocks a monitor watches, whichever moeflow path runs them: a :class:`~moeflow.MoELayer`
(moeflow's own model, a converted transformers model) or a transformers block whose experts run
through moeflow's expert-parallel backend (``ep_implementation="moeflow"``).

A block is found by what it is (a ``MoELayer``) or by what it offers: a module whose attribute
:data:`WATCH_ATTRIBUTE` is a function of its parent module (the MoE block that holds it, where the
router lives) returning a :class:`WatchedBlock`. The backend sets it on the experts it runs, so the
monitor needs nothing from transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from moeflow.comm.ledger import CollectiveLedger
from moeflow.core.stats import RoutingStats
from moeflow.moe.layer import MoELayer

WATCH_ATTRIBUTE = "moeflow_watch"
"""The attribute of a module that offers itself to the monitor: ``watch(parent) -> WatchedBlock``."""


class WatchedBlock(Protocol):
    """What the monitor reads of one MoE block. ``module``'s forward is hooked: its statistics
    (``last_stats``, over ``stats_ranks`` ranks) are read after it; ``router``'s output (a tensor,
    or a tuple whose first element is) holds the logits of the router's distribution; ``timed``: its
    statistics carry the all-to-all's measured seconds."""

    module: nn.Module
    router: nn.Module | None
    num_experts: int
    score_function: str
    stats_ranks: int
    ledger: CollectiveLedger
    timed: bool
    index: int | None

    @property
    def last_stats(self) -> RoutingStats | None:
        """The block's last forward's statistics (None: none ran yet)."""

    def bias(self) -> torch.Tensor | None:
        """The balancing bias on the router's selection, if any."""


class LayerBlock:
    """A :class:`~moeflow.MoELayer` as the monitor reads it."""

    timed = True

    def __init__(self, layer: MoELayer) -> None:
        self.module, self.router = layer, layer.gate
        self.num_experts, self.score_function = layer.config.num_experts, layer.config.score_function
        self.stats_ranks, self.ledger = layer.groups.size, layer.groups.ledger

    @property
    def index(self) -> int | None:
        return self.module.index

    @index.setter
    def index(self, value: int | None) -> None:
        self.module.index = value

    @property
    def last_stats(self) -> RoutingStats | None:
        return self.module.last_stats

    def bias(self) -> torch.Tensor | None:
        return self.module.gate.expert_bias


def watched_blocks(model: nn.Module) -> list[WatchedBlock]:
    """Every MoE block of ``model`` in the order of its modules: its ``MoELayer``\\ s and the modules
    that offer themselves (:data:`WATCH_ATTRIBUTE`)."""
    blocks: list[WatchedBlock] = []
    for parent in model.modules():
        if isinstance(parent, MoELayer):
            blocks.append(LayerBlock(parent))
            continue
        for child in parent.children():
            watch: Callable[[nn.Module], WatchedBlock] | None = getattr(child, WATCH_ATTRIBUTE, None)
            if watch is not None:
                blocks.append(watch(parent))
    return blocks
