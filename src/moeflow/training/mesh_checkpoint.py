"""Checkpoints of a user's own loop on a (dp, ep) DeviceMesh, with torch.distributed.checkpoint.

Every expert group names its experts with the same parameter names (``moe.experts.w1`` holds
experts 0-3 on one group, 4-7 on the other), so DCP on ``model.state_dict()`` would take them for
copies of one tensor. Here each expert tensor is given to DCP as what it is, a DTensor of the full
(E, ...) tensor: sharded over ``"ep"`` on the experts' dimension, and over ``"dp"`` as FSDP2 shards
it (:func:`~moeflow.training.data_parallel.shard_experts_over_replicas`) or replicated where the
experts are whole (DCP then writes one copy). The other weights go as they are: plain tensors
(DDP: replicated) or FSDP2's DTensors. AdamW's moments follow their parameter. DCP records every
chunk's offsets, so a checkpoint saved at one (EP, DP) loads at any other whose EP divides E,
each rank reading only its own chunks.

The layers' placements must be expert parallelism (E / EP whole experts per rank, in order): the
trainer's checkpoints (:mod:`moeflow.training.sharded_checkpoint`) cover hidden shards, slots and
packing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from moeflow.moe.layer import MoELayer
from moeflow.parallel.placement import ExpertPlacement

MODEL, OPTIMIZER = "model.", "optimizer."
"""The key prefixes of the model's tensors and of AdamW's state (``optimizer.<name>.<entry>``)."""
ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")

__all__ = ["load_mesh_checkpoint", "save_mesh_checkpoint"]


def save_mesh_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    mesh: DeviceMesh | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``'s AdamW state) to the DCP folder ``path``, each expert
    once; a collective over every rank. ``mesh``: the (dp, ep) mesh the layers' expert groups come
    from (None: the experts span all ranks)."""
    dcp.save(_state(_unwrapped(model), optimizer, mesh, create=False), checkpoint_id=str(path))


def load_mesh_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    mesh: DeviceMesh | None = None,
) -> None:
    """Read a checkpoint of :func:`save_mesh_checkpoint` (saved at any layout) into ``model`` (and
    ``optimizer``, whose AdamW state is created if it has none yet), in place; a collective."""
    state = _state(_unwrapped(model), optimizer, mesh, create=True)
    dcp.load(state, checkpoint_id=str(path))


def _unwrapped(model: nn.Module) -> nn.Module:
    """DDP's module (its state-dict names have no ``module.`` prefix); FSDP2 keeps the names."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: DeviceMesh | None,
           create: bool) -> dict[str, torch.Tensor]:
    """DCP's entries: views of the live tensors (a load writes into them)."""
    experts = dict(_expert_parameters(model))
    grid = _expert_grid(mesh, next(model.parameters()).device.type)
    _check_expert_groups(experts.values(), grid)
    state = {MODEL + name: _as_global(tensor, experts.get(name), grid) for name, tensor in model.state_dict().items()}
    if optimizer is None:
        return state
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(f"the mesh checkpoint holds Adam's or AdamW's state, not {type(optimizer).__name__}'s: "
                         "pass optimizer=None and save that state yourself")
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, parameter in model.named_parameters():
        if id(parameter) not in optimized:
            continue
        entries = optimizer.state[parameter]
        if create and not entries:  # AdamW's state before its first step, to read into
            entries.update(step=torch.zeros(()), exp_avg=torch.zeros_like(parameter),
                           exp_avg_sq=torch.zeros_like(parameter))
        for entry in ADAMW_STATE:
            if entry in entries:
                value = entries[entry]
                state[f"{OPTIMIZER}{name}.{entry}"] = value if entry == "step" else _as_global(
                    value, experts.get(name), grid)
    return state


def _expert_parameters(model: nn.Module) -> Iterator[tuple[str, MoELayer]]:
    """Each expert tensor's state-dict name, with its layer; refuses placements other than plain
    expert parallelism."""
    for prefix, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        plain = ExpertPlacement.expert_parallel(module.config.num_experts, module.world_size, module.config.hidden_dim)
        if module.placement != plain:
            raise ValueError(f"{prefix}: save_mesh_checkpoint takes expert-parallel placements (E / EP whole "
                             f"experts per rank); this layer runs {module.schedule.name} over another placement")
        for kind, _ in module.experts.named_parameters():
            yield f"{prefix}.experts.{kind}" if prefix else f"experts.{kind}", module


def _expert_grid(mesh: DeviceMesh | None, device_type: str) -> DeviceMesh | None:
    """The mesh with "ep" first: the experts' dimension splits over "ep" before "dp" (each expert
    group holds E / EP consecutive experts, which FSDP2 splits again over "dp"), on the device type
    of the parameters (a mesh of another would copy them, and a load would fill the copies)."""
    if mesh is None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return DeviceMesh(device_type, torch.arange(dist.get_world_size()).view(-1, 1),
                          mesh_dim_names=("ep", "dp"), _init_backend=False)
    names = mesh.mesh_dim_names or ()
    if set(names) != {"dp", "ep"}:
        raise ValueError(f"mesh must be 2-D with dims named ('dp', 'ep'), got {names or mesh.ndim}")
    order = [names.index("ep"), names.index("dp")]
    # coordinates only (DCP's offsets): no process group of its own, so a checkpoint every few steps makes none
    return DeviceMesh(device_type, mesh.mesh.permute(order), mesh_dim_names=("ep", "dp"), _init_backend=False)


def _check_expert_groups(layers: Iterable[MoELayer], grid: DeviceMesh | None) -> None:
    """Each layer's expert group must be this rank's "ep" row of the grid, in rank order: the
    chunks' offsets come from the grid."""
    if grid is None:
        return
    row = grid.mesh[:, grid.get_coordinate()[1]].tolist()  # type: ignore[index]
    for layer in layers:
        if list(layer.groups.members) != row:
            raise ValueError(f"an MoE layer's expert group (ranks {layer.groups.members}) is not this rank's mesh "
                             f'"ep" group (ranks {row}): pass the (dp, ep) mesh the layers were built on')


def _as_global(tensor: torch.Tensor, layer: MoELayer | None, grid: DeviceMesh | None) -> torch.Tensor:
    """An expert tensor as a DTensor of the full (E, ...) tensor on the (ep, dp) grid; any other
    tensor as it is."""
    if layer is None or grid is None:
        return tensor
    over_dp: Placement = Replicate()
    local = tensor
    if isinstance(tensor, DTensor):  # FSDP2's shard over "dp" of this rank's experts
        (over_dp,) = tensor.placements
        local = tensor.to_local()
    shape = (tensor.shape[0] * layer.world_size, *tensor.shape[1:])
    return DTensor.from_local(local, grid, [Shard(0), over_dp], shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
