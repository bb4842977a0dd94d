"""Data parallelism that knows the experts, for a user's own training loop.

``expert_data_parallel(model)`` is ``DistributedDataParallel`` over the weights every rank holds
whole, with the experts left out of it; ``expert_fully_shard(model)`` is FSDP2's ``fully_shard``
on those weights, as torchtitan composes it. In both, each expert's gradient is made the gradient
of the mean loss over the data-parallel replicas by a hook on its parameter
(:func:`reduce_experts_in_backward`): scaled, and summed over its copies where it has some
(:mod:`moeflow.parallel.expert_parameters` holds the rules). ``clip_grad_norm_`` clips by the norm of the
whole model's gradient, each expert counted once, where ``torch.nn.utils.clip_grad_norm_`` on a
rank's own parameters would see only that rank's experts.

The dense weights' reduction runs on a process group of its own: the layer's all-to-alls run on
the expert group during the backward, possibly from its communication thread, and collectives of
two threads on one group must not interleave differently on different ranks.

Expert parallelism inside data parallelism is a ``(dp, ep)`` :class:`DeviceMesh`: each MoE layer
places its experts over ``mesh["ep"]`` (``MoELayer(..., group=mesh["ep"].get_group())``), the
dense weights are averaged over the whole mesh, and each expert's gradient is also summed over
its replicas, the ranks of ``mesh["dp"]`` that hold the same experts in the other expert groups.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from moeflow.comm.collectives import all_reduce
from moeflow.comm.groups import group_size
from moeflow.moe.layer import MoELayer
from moeflow.parallel.expert_parameters import (
    data_parallel_replicas,
    is_expert_parameter,
    reduce_expert_gradient,
    squared_norm_share,
)

EXPERT_PARALLEL_DIM = "ep"
"""The mesh dimension the experts are placed over (each MoE layer's expert group)."""
EXPERT_REPLICA_DIM = "dp"
"""The mesh dimension over which every expert has a replica in each other expert group."""

__all__ = ["clip_grad_norm_", "expert_data_parallel", "expert_fully_shard", "expert_parameter_names",
           "reduce_experts_in_backward", "shard_experts_over_replicas"]


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [module for module in model.modules() if isinstance(module, MoELayer)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s expert parameters (those marked ``skip_allreduce``)."""
    return [name for name, parameter in model.named_parameters() if is_expert_parameter(parameter)]


def reduce_experts_in_backward(
    model: nn.Module, data_parallel: dist.ProcessGroup | None = None, replicas: dist.ProcessGroup | None = None
) -> None:
    """Hook every expert parameter of ``model``'s MoE layers so that the gradient the backward
    accumulates is the gradient of the mean loss over the data-parallel replicas (each expert's
    copies summed, then summed over ``replicas``, then scaled); done once per parameter. Gradient
    accumulation over several backwards works: the hook sees each backward's own gradient.
    ``data_parallel``: the group the rest of the model is averaged over (checked against each
    layer's expert group); ``replicas``: the ranks holding the same experts in the other expert
    groups (a (dp, ep) mesh's ``mesh["dp"]``), None where the expert group spans the data-parallel one."""
    for layer in moe_layers(model):
        _check_expert_group(layer, data_parallel, replicas)
        for parameter in layer.experts.parameters():
            if getattr(parameter, "_moeflow_reduction", None) is None:
                parameter._moeflow_reduction = parameter.register_hook(  # type: ignore[attr-defined]
                    functools.partial(_reduced, layer, replicas))


def _reduced(layer: MoELayer, replicas: dist.ProcessGroup | None, grad: torch.Tensor) -> torch.Tensor:
    return reduce_expert_gradient(grad, layer.placement, layer.groups, replicas)


def _check_expert_group(
    layer: MoELayer, data_parallel: dist.ProcessGroup | None, replicas: dist.ProcessGroup | None = None
) -> None:
    """The experts' rules assume that the expert groups and their replicas tile the data-parallel
    group (an expert group smaller than it without ``replicas`` would leave the copies of every
    expert in the other expert groups unreduced), and the dense weights' reduction must run on
    another group than the layer's all-to-alls (see the module's docstring)."""
    if data_parallel is None:
        return
    if layer.groups.size * group_size(replicas) != group_size(data_parallel):
        raise ValueError(
            f"the MoE layer's expert group has {layer.groups.size} ranks and {group_size(replicas)} replica(s) but "
            f"the data-parallel group has {group_size(data_parallel)}: give the layer the data-parallel ranks "
            "(group=...) as its expert group, or lay the ranks out on a (dp, ep) DeviceMesh, give the layer "
            'mesh["ep"].get_group() and pass mesh=mesh'
        )
    if data_parallel == layer.groups.expert:
        raise ValueError(
            "the data-parallel process group is the MoE layer's expert group, on which its all-to-alls run during "
            "the backward: give data parallelism a group of its own (the default, dist.new_group())"
        )


def expert_data_parallel(
    model: nn.Module, process_group: dist.ProcessGroup | None = None, mesh: DeviceMesh | None = None,
    **ddp_options: Any,
) -> DistributedDataParallel:
    """``DistributedDataParallel(model)`` that leaves the experts alone: DDP neither broadcasts
    them from rank 0 nor averages them (they are on its ignore list), and each expert's gradient is
    reduced over its own copies (:func:`reduce_experts_in_backward`). ``process_group`` is DDP's
    (default: a new group of all ranks, apart from the experts' group). ``mesh``: a (dp, ep) mesh
    whose ``"ep"`` groups are the layers' expert groups: DDP then averages the dense weights over
    the whole mesh and each expert is also summed over its ``"dp"`` replicas. ``ddp_options`` go to DDP."""
    replicas = None
    if mesh is not None:
        process_group, replicas = _mesh_groups(model, mesh)
    elif process_group is None:
        process_group = dist.new_group()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))
    reduce_experts_in_backward(model, process_group, replicas)
    return DistributedDataParallel(model, process_group=process_group, **ddp_options)


def _mesh_groups(model: nn.Module, mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """A (dp, ep) mesh's groups: one over every rank of the mesh for the dense weights (a new one,
    apart from the expert groups), and ``mesh["dp"]``'s, the experts' replicas. Each MoE layer
    must place its experts over ``mesh["ep"]``."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim != 2 or set(names) != {EXPERT_REPLICA_DIM, EXPERT_PARALLEL_DIM}:
        raise ValueError(f"mesh must be 2-D with dims named ({EXPERT_REPLICA_DIM!r}, {EXPERT_PARALLEL_DIM!r}) "
                         f"(init_device_mesh(device, (dp, ep), mesh_dim_names=('dp', 'ep'))), got {names or mesh.ndim}")
    expert_ranks = dist.get_process_group_ranks(mesh[EXPERT_PARALLEL_DIM].get_group())
    for layer in moe_layers(model):
        if layer.groups.expert is None or dist.get_process_group_ranks(layer.groups.expert) != expert_ranks:
            raise ValueError(f"an MoE layer's expert group is not this rank's mesh[{EXPERT_PARALLEL_DIM!r}] group "
                             f"(ranks {expert_ranks}): build it with group=mesh[{EXPERT_PARALLEL_DIM!r}].get_group()")
    dense = dist.new_group(sorted(mesh.mesh.flatten().tolist()))  # every rank of the world takes part
    return dense, mesh[EXPERT_REPLICA_DIM].get_group()


def expert_fully_shard(
    model: nn.Module, blocks: tuple[nn.Module, ...] = (), mesh: DeviceMesh | None = None, shard_experts: bool = True,
    **fsdp_options: Any,
) -> nn.Module:
    """FSDP2's ``fully_shard`` on ``model``'s weights other than the experts (each of ``blocks``
    its own unit, then the root). ``mesh``: the data-parallel mesh (default: all ranks, on a
    process group apart from the experts'), whose experts stay whole on their ranks, reduced over
    their copies (:func:`reduce_experts_in_backward`); or a (dp, ep) mesh whose ``"ep"`` groups
    are the layers' expert groups: the dense weights are sharded over the whole mesh and, with
    ``shard_experts`` (torchtitan's layout), each layer's experts over their ``"dp"`` replicas
    (:func:`shard_experts_over_replicas`), else they stay whole, summed over those replicas.
    ``fsdp_options`` go to ``fully_shard``. Seed every rank alike: FSDP2 shards each rank's own
    initial weights, it broadcasts nothing."""
    from torch.distributed.fsdp import fully_shard  # FSDP pulls in much: only for those who use it

    device = next(model.parameters()).device.type
    replicas, whole = None, True
    if mesh is None:
        mesh = DeviceMesh.from_group(dist.new_group(), device)
    elif mesh.ndim == 2:
        if shard_experts:
            _refuse_copies(model)  # before any group is made
        dense, replicas = _mesh_groups(model, mesh)
        if shard_experts:
            shard_experts_over_replicas(model, mesh[EXPERT_REPLICA_DIM], **fsdp_options)
            whole = False
        mesh = DeviceMesh.from_group(dense, device)
    experts = {p for layer in moe_layers(model) for p in layer.experts.parameters()} if whole else set()
    for block in blocks:
        fully_shard(block, mesh=mesh, ignored_params=experts, **fsdp_options)
    fully_shard(model, mesh=mesh, ignored_params=experts, **fsdp_options)
    if whole:
        reduce_experts_in_backward(model, mesh.get_group(), replicas)
    return model


def shard_experts_over_replicas(model: nn.Module, replicas: DeviceMesh, **fsdp_options: Any) -> None:
    """Each MoE layer's experts its own FSDP2 unit over ``replicas`` (a (dp, ep) mesh's ``"dp"``
    dimension: the ranks that hold the same experts in the other expert groups), as torchtitan
    shards them: every rank keeps 1/DP of its expert group's share, gathered around the
    experts' step of each call (:meth:`~moeflow.core.experts.ExpertFFN.run_with_weights`), the gradients
    reduce-scattered over the replicas (a sum, then divided by every data-parallel replica: the mean
    loss; a sum because gloo has no pre-scaled reduction).
    Refused for placements whose experts have copies: their copies' gradients must add up first."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    _refuse_copies(model)
    for layer in moe_layers(model):
        placement_fn = functools.partial(_even_shard, replicas.size())
        fully_shard(layer.experts, mesh=replicas, **{"shard_placement_fn": placement_fn, **fsdp_options})
        register_fsdp_forward_method(layer.experts, "run_with_weights")
        if not hasattr(layer.experts, "set_force_sum_reduction_for_comms"):
            raise RuntimeError("this torch's FSDP2 cannot set a gradient divide factor with a sum reduction "
                               "(FSDPModule.set_force_sum_reduction_for_comms): upgrade torch, or pass "
                               "shard_experts=False")
        replicas_per_group = data_parallel_replicas(layer.groups) * replicas.size()
        layer.experts.set_gradient_divide_factor(float(replicas_per_group))  # type: ignore[operator]
        layer.experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # gloo has no PREMUL_SUM


def clip_grad_norm_(model: nn.Module, max_norm: float, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale ``model``'s gradients so that the 2-norm of the whole model's gradient is at most
    ``max_norm``, and return that norm (computed in fp32 whatever the gradients' dtype): the
    weights every rank holds whole counted once (FSDP2's shards summed over their mesh), every
    expert counted once over its expert group. A collective: every rank calls it."""
    layers = moe_layers(model)
    experts = {id(p) for layer in layers for p in layer.experts.parameters()}
    dense = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in experts]
    total = (_dense_squared_norm(dense) + _expert_squared_norm(layers)).sqrt().to(torch.float32)
    norm = float(total)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"the gradient's norm is {norm}: a loss or gradient is not finite")
    scale = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and scale < 1.0:  # one float: plain tensors, experts and DTensors alike
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(scale)
    return total


def _dense_squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared norm of the weights held whole (plain tensors, the same on every rank) and of
    FSDP2's sharded ones (DTensors: their norm is a reduction over their mesh), read to the host once."""
    norms = [torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads]
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(norms).double().square().sum().cpu()


def _refuse_copies(model: nn.Module) -> None:
    """Sharded experts take one copy of each expert, read only inside the layer's dispatcher: refuse
    (making no group) copies, whose gradients add up before the replicas', and FasterMoE's shadows,
    whose gradient sum would race FSDP2's reduce-scatter."""
    for layer in moe_layers(model):
        if layer.placement.copies_block() is not None or layer.placement.split_tokens:
            raise ValueError(
                f"an MoE layer's placement ({layer.schedule.name}) keeps copies of its experts, whose gradients "
                "add up over the copies before the replicas: FSDP2 on experts takes one copy per expert "
                "(parallel='expert' or hidden shards); pass shard_experts=False to keep them whole")
        if layer.config.shadowing != "off":
            raise ValueError("an MoE layer shadows experts (FasterMoE), whose gradients are summed back during the "
                             "backward: FSDP2 on experts does not run beside it; build the layer with "
                             "shadowing='off' or pass shard_experts=False to keep the experts whole")


def _even_shard(ways: int, parameter: torch.Tensor) -> Shard:
    """Shard an expert tensor on its first dimension that splits ``ways`` evenly (the experts, else
    the model or hidden one: fewer local experts than replicas would leave some ranks none)."""
    return Shard(next((dim for dim, size in enumerate(parameter.shape) if size % ways == 0), 0))


def _expert_squared_norm(layers: list[MoELayer]) -> torch.Tensor:
    """The experts' squared norm: each rank's share summed over each layer's expert group, and
    over the replicas its experts are FSDP2-sharded over (each rank's shard counted once)."""
    by_groups: dict[tuple[int, ...], tuple[tuple[dist.ProcessGroup | None, ...], list[float]]] = {}
    device = layers[0].experts.w1.device if layers else torch.device("cpu")
    for layer in layers:
        for parameter in layer.experts.parameters():
            if parameter.grad is None:
                continue
            grad, shards = _local_gradient(parameter.grad)
            groups = (layer.groups.expert, shards)
            shares = by_groups.setdefault(tuple(id(group) for group in groups), (groups, []))[1]
            shares.append(squared_norm_share(grad, layer.placement, layer.rank))
    squared = torch.zeros((), dtype=torch.float64)
    for groups, shares in by_groups.values():
        part = torch.tensor(sum(shares), dtype=torch.float64, device=device)
        for group in groups:
            if group is not None and group_size(group) > 1:
                all_reduce(part, group)
        squared += part.cpu()
    return squared


def _local_gradient(grad: torch.Tensor) -> tuple[torch.Tensor, dist.ProcessGroup | None]:
    """A gradient's local part, and the group its shards span (None: held whole)."""
    if isinstance(grad, DTensor):
        return grad.to_local(), grad.device_mesh.get_group()
    return grad, None
