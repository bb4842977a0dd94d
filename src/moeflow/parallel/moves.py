"""Moving expert weights, and their optimizer state, from one placement to another.

Every strategy change goes through here: Lina's packing (fewer or more experts per rank), EPLB's
rebalancing (the slots' experts change), inference scheduling (every rank gathers every expert)
and the first refresh of redundant copies from their primaries. Each tensor travels as the full
(E, ...) tensor assembled from the primary copies (one all-reduce), then sliced for this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.core.experts import ExpertFFN
from moeflow.parallel.expert_parameters import holds_shards
from moeflow.parallel.placement import ExpertPlacement, gather_full


def move_slots(
    tensor: torch.Tensor, kind: str, old: ExpertPlacement, new: ExpertPlacement, rank: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``tensor`` (this rank's slots under ``old``) rewritten for ``new``."""
    full = gather_full(tensor, old, kind, rank, group)
    return new.shard_tensor(kind, full, rank)


@torch.no_grad()
def move_experts(
    experts: ExpertFFN, old: ExpertPlacement, new: ExpertPlacement, rank: int, group: dist.ProcessGroup | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Rewrite ``experts`` for ``new`` (each slot from its expert's primary copy), with every
    optimizer state tensor shaped like its parameter (AdamW's moments); a collective."""
    if holds_shards(experts):
        raise ValueError("these experts are sharded (FSDP2 over their data-parallel replicas): a placement that moves "
                         "them at run time (balance, packing, redundant slots) needs them whole: "
                         "expert_fully_shard(..., shard_experts=False)")
    for kind, parameter in list(experts.named_parameters()):
        state = optimizer.state.get(parameter, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == parameter.shape:
                state[key] = move_slots(value, kind, old, new, rank, group)
        moved = move_slots(parameter, kind, old, new, rank, group)
        if moved.shape == parameter.shape:
            parameter.copy_(moved)
        else:  # more or fewer slots (packing): a new Parameter, in the optimizer's place of the old
            _replace_parameter(experts, kind, parameter, moved, optimizer)


def _replace_parameter(
    experts: ExpertFFN, kind: str, old: nn.Parameter, value: torch.Tensor, optimizer: torch.optim.Optimizer | None
) -> None:
    """A reshaped expert parameter is a new Parameter (autograd keeps a leaf's shape), which takes
    the old one's place and state in ``optimizer``."""
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    setattr(experts, kind, new)
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)
