"""Which parameters are experts, and the rules their gradients follow under data parallelism.

An expert parameter holds a rank's own part of the experts (its placement says which), so the
data-parallel rules of ordinary weights are wrong for it: broadcasting rank 0's copy at start-up
would make every rank's experts rank 0's, and averaging gradients would average expert e with
another rank's expert. Under the expert-parallel exchange an expert's gradient already sums the
tokens of every rank that sent it some, so it is only scaled to the mean over the data-parallel
replicas; copies of an expert (replicated experts, Lina's packed blocks) each sum their own ranks'
tokens, so the copies add up first. One module holds these rules for the trainer and for the
helpers a user's own loop calls (:mod:`moeflow.training.data_parallel`).

The marker is Tutel's: ``skip_allreduce = True`` on every expert parameter (and DeepSpeed-MoE's
``allreduce = False``), so that other frameworks' data parallelism can find them too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.comm.collectives import all_reduce
from moeflow.comm.groups import ParallelGroups, group_size
from moeflow.parallel.placement import ExpertPlacement, Sharding

#: The attribute set on every expert parameter (Tutel's name; DeepSpeed-MoE also gets ``allreduce=False``).
EXPERT_MARKER = "skip_allreduce"


def mark_expert_parameters(experts: nn.Module) -> None:
    """Mark ``experts``' parameters as expert parameters (Tutel's and DeepSpeed-MoE's attributes)."""
    for parameter in experts.parameters():
        setattr(parameter, EXPERT_MARKER, True)
        parameter.allreduce = False  # type: ignore[attr-defined]


def is_expert_parameter(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` carries the expert marker."""
    return bool(getattr(parameter, EXPERT_MARKER, False))


def holds_shards(experts: nn.Module) -> bool:
    """Whether ``experts``' parameters are FSDP2's shards over their replicas (DTensors), not this
    rank's whole experts (by type name: the layer's import does not pull in DTensor)."""
    return any(type(parameter).__name__ == "DTensor" for parameter in experts.parameters())


def data_parallel_replicas(groups: ParallelGroups) -> int:
    """How many data-parallel replicas the expert group holds: its ranks, or its ranks over the
    tensor-parallel group's when the members of one (Parm's MP group) share the same tokens."""
    return groups.size // group_size(groups.model)


def copies_group(placement: ExpertPlacement, groups: ParallelGroups) -> dist.ProcessGroup | None:
    """The group over which copies of this rank's experts add up their gradients: the ranks a block
    apart for packed blocks, all ranks for replicated experts; None when each expert part lives on
    one rank (expert parallelism, hidden shards, EPLB's slots, whose copies split the tokens)."""
    block = placement.copies_block()
    return groups.strided(block) if block is not None else None


def reduce_expert_gradient(
    grad: torch.Tensor, placement: ExpertPlacement, groups: ParallelGroups, replicas: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """An expert parameter's gradient as the gradient of the mean loss over the data-parallel
    replicas: the copies' gradients summed (a collective over :func:`copies_group`), then summed
    over ``replicas`` (the ranks that hold the same experts in the other expert groups: the "dp"
    dimension of a (dp, ep) mesh), then scaled by every data-parallel replica's share."""
    group = copies_group(placement, groups)
    summed = [reduced for reduced in (group, replicas) if reduced is not None and group_size(reduced) > 1]
    if summed:
        grad = grad.clone()
    for reduced in summed:
        all_reduce(grad, reduced)
    return grad / (data_parallel_replicas(groups) * group_size(replicas))


def squared_norm_share(grad: torch.Tensor, sharding: Sharding, rank: int) -> float:
    """This rank's share of the squared norm of a sharded gradient, so that the sum over the group
    counts every expert (or expert slice) once: copies in blocks count a block's share each,
    EPLB's redundant slots only their primary copy (the copies hold the same summed gradient)."""
    block = sharding.copies_block()
    if block is not None:
        return float(grad.double().pow(2).sum()) * block / sharding.world_size
    counted = sharding.counted_slots(rank)
    return float((grad if counted is None else grad[counted.to(grad.device)]).double().pow(2).sum())
