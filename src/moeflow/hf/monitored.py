"""A transformers MoE block run by moeflow's expert-parallel backend, as
:class:`~moeflow.metrics.MoEMonitor` reads it (:class:`~moeflow.metrics.blocks.WatchedBlock`): the
backend's statistics of the block's forward, the router the block's family keeps
(:mod:`moeflow.hf.families`), its selection bias where the family has one.

The backend measures no all-to-all seconds (that would synchronise the device every call), so its
blocks' ``alltoall_s`` is None; the bytes are its forward's exchanges."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from moeflow.comm.groups import ParallelGroups
from moeflow.core.stats import ExecutionPlan, RoutingStats
from moeflow.hf.families import Family, family_of, router_module, selection_bias


class Implementation(Protocol):
    """What a block reads of the backend's implementation that runs it (``MoeflowEP``)."""

    expert_module: nn.Module
    num_local_experts: int
    groups: ParallelGroups
    last_stats: RoutingStats | None
    index: int | None


def routing_stats(counts: list[int], top_k: int, plan: ExecutionPlan) -> RoutingStats:
    """A dropless forward's statistics: ``counts`` (token, expert) pairs per expert over the group."""
    return RoutingStats(num_tokens=sum(counts) // top_k, top_k=top_k, capacity=0, capacity_factor=0.0,
                        tokens_per_expert=counts, dropped_per_expert=[0] * len(counts), plan=plan)


def _router(block: nn.Module, family: Family) -> nn.Module | None:
    """The module whose output holds the router's logits (None: the family's path finds none)."""
    owner = router_module(block, family)
    return owner if isinstance(owner, nn.Module) else None


class BackendBlock:
    """One block of a model loaded with ``ep_implementation="moeflow"``."""

    timed = False

    def __init__(self, implementation: Implementation, block: nn.Module) -> None:
        self.implementation, self.block, self.module = implementation, block, implementation.expert_module
        self.family = family_of(block)
        self.router = _router(block, self.family) if self.family is not None else None
        self.score_function = self.family.score_function if self.family is not None else "softmax"
        self.num_experts = implementation.num_local_experts * implementation.groups.size
        self.stats_ranks, self.ledger = implementation.groups.size, implementation.groups.ledger

    @property
    def index(self) -> int | None:
        return self.implementation.index

    @index.setter
    def index(self, value: int | None) -> None:
        self.implementation.index = value

    @property
    def last_stats(self) -> RoutingStats | None:
        return self.implementation.last_stats

    def bias(self) -> torch.Tensor | None:
        return selection_bias(self.block, self.family) if self.family is not None else None
