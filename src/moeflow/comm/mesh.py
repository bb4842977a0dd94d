"""DeviceMeshes whose groups time out as the world group does.

torch makes a mesh's groups with its default timeout for a new group (30 minutes on gloo), not the
world's: a worker stopped inside a collective on such a group would hold the job that long. The
groups here are torch's own, made by ``init_device_mesh`` with the backend's options.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeflow.comm.groups import group_timeout


def backend_options(timeout: timedelta) -> tuple[str, object]:
    """The world's backend and its options with ``timeout``: what a new mesh group is made with."""
    backend = str(dist.get_backend())
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


def timed_mesh(device_type: str, shape: Sequence[int], names: Sequence[str], timeout: timedelta) -> DeviceMesh:
    """``init_device_mesh(device_type, shape, names)`` with every dimension's group timing out after ``timeout``."""
    override = backend_options(timeout)
    try:
        return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names),
                                backend_override=dict.fromkeys(names, override))
    except TypeError:  # a torch before backend_override (2.9): the groups keep torch's default timeout
        return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def second_group(mesh: DeviceMesh, dim: str) -> dist.ProcessGroup:
    """This rank's second group along ``mesh``'s ``dim``: the ranks of ``mesh.get_group(dim)`` in a
    group of their own (timing out as it does), so that two threads' collectives, one on each,
    never pair. Every rank of the mesh makes every one of them, in the mesh's order (torch's
    ``new_subgroups_by_enumeration``)."""
    names = tuple(mesh.mesh_dim_names or ())
    axis = names.index(dim)
    rows = mesh.mesh.movedim(axis, -1).reshape(-1, mesh.size(axis)).tolist()
    group, _ = dist.new_subgroups_by_enumeration(rows, timeout=group_timeout(mesh.get_group(dim)))
    return group
