"""The routing load every rank agrees on before capacity: one small all-gather per forward."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moeflow.capacity import expert_capacity
from moeflow.comm.groups import ParallelGroups


@dataclass(frozen=True)
class GlobalLoad:
    """Routing counts of every rank, exchanged once per forward."""

    counts_WE: torch.Tensor  # assignments each rank routes to each expert
    max_tokens_per_rank: int
    estimate_E: np.ndarray | None = None  # an inference hook's estimated selections, summed over ranks

    @property
    def needed_capacity(self) -> int:
        return int(self.counts_WE.max()) if self.counts_WE.numel() else 0

    def capacity(self, capacity_factor: float, top_k: int) -> int:
        """The slots per expert per rank this load gets (the same on every rank)."""
        return expert_capacity(capacity_factor, top_k, self.max_tokens_per_rank, self.counts_WE.shape[1],
                               self.needed_capacity)


def exchange_load(
    counts_E: torch.Tensor, num_tokens: int, estimate_E: np.ndarray | None, groups: ParallelGroups
) -> GlobalLoad:
    """Every rank learns every rank's routing counts: capacity must agree across ranks. An
    inference hook's estimate rides along (as float64, which holds the counts exactly)."""
    if groups.expert is None:  # one copy to the host (the sync capacity needs), the rest built there
        counts_E = counts_E.cpu()
    local = torch.cat([counts_E, counts_E.new_tensor([num_tokens])])
    if estimate_E is not None:
        estimate = torch.from_numpy(np.asarray(estimate_E, dtype=np.float64))
        local = torch.cat([local.double(), estimate.to(local.device)])
    if groups.expert is None:
        gathered = local.unsqueeze(0)
    else:
        parts = [torch.empty_like(local) for _ in range(groups.size)]
        with groups.ledger.tracked("load all-gather", groups.expert, local.numel() * local.element_size()):
            dist.all_gather(parts, local, group=groups.expert)
        gathered = torch.stack(parts).cpu()
    experts = counts_E.shape[0]
    return GlobalLoad(
        counts_WE=gathered[:, :experts].to(counts_E.dtype), max_tokens_per_rank=int(gathered[:, experts].max()),
        estimate_E=None if estimate_E is None else gathered[:, experts + 1:].sum(0).numpy(),
    )
