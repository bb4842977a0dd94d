"""Gradient synchronisation across the workers: the replicated parameters averaged (data parallel),
the experts scaled or summed by how their copies are placed, tensor-parallel heads averaged over
their replicas, and the global clipping norm with every sharded gradient counted once."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moeflow.comm.collectives import all_reduce, flat_sum
from moeflow.comm.groups import group_size
from moeflow.comm.ledger import CollectiveLedger, tracked
from moeflow.models import TrainableLM
from moeflow.parallel.expert_parameters import squared_norm_share
from moeflow.parallel.placement import PlacedParameter
from moeflow.training.grad_sync import GradientScheduler


def all_reduce_sum(
    values: list[float], group: dist.ProcessGroup | None, device: torch.device, ledger: CollectiveLedger | None = None
) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if group is not None:
        with tracked(ledger, "sum all-reduce", group, tensor.numel() * 8):
            all_reduce(tensor, group)
    return tensor.tolist()


def replicated_parameters(model: TrainableLM, expert_names: set[str]) -> list[torch.nn.Parameter]:
    """The parameters every worker holds whole (neither experts nor tensor-parallel heads), in
    reverse registration order: roughly the order the backward finishes their gradients."""
    sharded = expert_names | model.tensor_parallel_parameter_names()
    return [p for name, p in reversed(list(model.named_parameters())) if name not in sharded]


def synchronize_gradients(
    model: TrainableLM, expert_names: set[str], group: dist.ProcessGroup | None, world_size: int,
    scheduler: GradientScheduler | None = None, copies: GradientScheduler | None = None,
    expert_replicas: dist.ProcessGroup | None = None, head_replicas: dist.ProcessGroup | None = None,
) -> float:
    """Average the replicated parameters' gradients over the workers (one flat all-reduce, or what
    ``scheduler`` reduced during the backward), scale the experts' (each already sums every
    data-parallel replica's tokens) to the same mean, add up a packed expert's copies (or take what
    ``copies`` reduced during the backward), and average tensor-parallel attention's over the
    replicas of the same heads; return this worker's share of the squared norm of the sharded
    gradients, whose sum over the workers is theirs, for the global clipping norm. With MP groups
    of N workers the W workers are W / N data-parallel replicas. ``expert_replicas`` (``--ep-size``):
    the workers holding the same experts in the other expert groups, over which the experts'
    gradients are summed first (and their norm then counted by one of them). ``head_replicas``
    (``--mp-size``): the workers holding the same attention heads over the whole world; None where
    the expert group is the world (then its ranks ``N`` apart are they)."""
    heads = model.tensor_parallel_parameter_names()
    replicas = world_size // group_size(model.groups.model)
    replicated, heads_grads, sharded_sq = [], [], 0.0
    experts: list[tuple[torch.Tensor, PlacedParameter]] = []
    packed: dict[int, list[tuple[torch.Tensor, PlacedParameter]]] = {}  # packed experts by block size
    placed = model.placed_parameters()
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        block = packed_block(placed.get(name)) if name in expert_names else None
        if block is not None:
            packed.setdefault(block, []).append((parameter, placed[name]))
        elif name in expert_names:
            experts.append((parameter.grad, placed[name]))
        elif name in heads:
            heads_grads.append(parameter.grad)
        else:
            replicated.append(parameter.grad)
    copies_of_experts = group_size(expert_replicas)
    if copies_of_experts > 1:
        flat_sum([grad for grad, _ in experts], expert_replicas)  # summed over the copies
    for grad, where in experts:
        grad.div_(replicas)
        sharded_sq += squared_norm_share(grad, where.sharding, model.groups.rank) / copies_of_experts
    if scheduler is not None:
        scheduler.finish()
    elif group is not None and world_size > 1:
        _average(replicated, group, world_size)
    if copies is not None:
        copies.finish()
    for block, parameters in packed.items():  # each block's copy summed its own tokens: add the copies
        grads = [p.grad for p, _ in parameters]
        if copies is None:  # (the scheduler's groups span the world: the expert groups' copies too)
            flat_sum(grads, model.groups.strided(block))
            _average(grads, expert_replicas if copies_of_experts > 1 else None, replicas)
        sharded_sq += sum(squared_norm_share(p.grad, placed.sharding, model.groups.rank)
                          for p, placed in parameters) / copies_of_experts
    if heads_grads:
        heads_group = head_replicas if head_replicas is not None else model.groups.strided(world_size // replicas)
        _average(heads_grads, heads_group, replicas)
        sharded_sq += sum(float(g.pow(2).sum()) for g in heads_grads) / replicas  # each replica counts once
    return sharded_sq


def packed_block(placed: PlacedParameter | None) -> int | None:
    """The block size of a packed expert parameter whose copies sit in several blocks (Lina's
    packing), else None (expert parallel, or not an expert)."""
    return placed.sharding.copies_block() if placed is not None else None


def _average(grads: list[torch.Tensor], group: dist.ProcessGroup | None, size: int) -> None:
    """The mean of each gradient over ``group`` of ``size`` workers (one flat all-reduce)."""
    flat_sum(grads, group if size > 1 else None, size)


def clip_gradients(model: TrainableLM, expert_names: set[str], expert_sq_global: float, max_norm: float) -> float:
    """Clip by the norm of the whole (global) gradient; return that norm. ``expert_sq_global`` is
    the sharded gradients' part (experts, tensor-parallel attention), summed over the workers."""
    sharded = expert_names | model.tensor_parallel_parameter_names()
    replicated_sq = sum(
        float(p.grad.pow(2).sum()) for n, p in model.named_parameters() if n not in sharded and p.grad is not None
    )
    norm = math.sqrt(replicated_sq + expert_sq_global)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(scale)
    return norm
