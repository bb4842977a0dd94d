"""A pipeline's process groups, from its mesh: made up front, by every rank, in one order.

The mesh is ``(pp[, dp][, ep])``: the stages over ``pp``; inside a stage, the experts over ``ep``
and copies of the stage over ``dp``. Every rank of a stage (its ``dp`` x ``ep`` ranks) reads a
batch of its own; the replicated parameters' gradients sum over all of them, the experts' over
``dp`` only (the all-to-all's backward already summed the ``ep`` ranks' tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moeflow.comm.groups import group_size, group_timeout
from moeflow.comm.mesh import backend_options, second_group
from moeflow.pipeline.layout import PipelineSchedule
from moeflow.pipeline.tied import tied_embedding_group

MESH_DIMS = ("pp", "dp", "ep")
"""The dimensions a pipeline's mesh may have, outermost first (``pp`` required)."""


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's groups: its pipeline (``pp``), its stage's data ranks (``dp`` x ``ep``), its
    expert group (``ep``), its experts' copies (``dp``), the tied embedding's pair, and, for an
    overlapped V schedule, a second expert group of the same ranks (``second_experts``: the
    rank's second stage's, whose collectives run beside the first's)."""

    pp: dist.ProcessGroup
    data: dist.ProcessGroup | None
    experts: dist.ProcessGroup | None
    replicas: dist.ProcessGroup | None
    tied: dist.ProcessGroup | None
    second_experts: dist.ProcessGroup | None = None

    @property
    def data_size(self) -> int:
        """How many ranks of a stage read batches of their own."""
        return group_size(self.data)

    @property
    def counts_replicated(self) -> bool:
        """Whether this rank adds the stage's replicated parameters to the gradient norm (one rank
        of the stage does: the others hold the same gradients)."""
        return self.data is None or dist.get_rank(self.data) == 0

    @property
    def counts_experts(self) -> bool:
        """Whether this rank adds its experts to the gradient norm (one copy of each does)."""
        return self.replicas is None or dist.get_rank(self.replicas) == 0


def check_mesh(mesh: DeviceMesh) -> None:
    """A mesh with a ``pp`` dimension and at most ``dp`` and ``ep`` beside it, in that order."""
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names or names != tuple(dim for dim in MESH_DIMS if dim in names):
        raise ValueError(f"pipeline_stages takes a mesh with dimensions ('pp', 'dp', 'ep') or a leading part of "
                         f"them with 'pp' first, got {names}: init_device_mesh(device, (pp, dp, ep), "
                         "mesh_dim_names=('pp', 'dp', 'ep'))")


def pipeline_groups(
    mesh: DeviceMesh, kind: PipelineSchedule, stages_per_rank: int, overlap: bool = False
) -> PipelineGroups:
    """The groups of ``mesh`` for a pipeline under ``kind`` (``overlap``: with the second expert
    group the overlap needs, where there is an expert group); every rank of the mesh calls it."""
    check_mesh(mesh)
    names = mesh.mesh_dim_names
    inside = [dim for dim in ("dp", "ep") if dim in names and mesh.size(names.index(dim)) > 1]
    timeout = group_timeout(mesh.get_group("pp"))  # the groups made here time out as the mesh's do
    override = backend_options(timeout) if timeout is not None else None
    data = (None if not inside else mesh.get_group(inside[0]) if len(inside) == 1  # torch's flattening (torchtitan's)
            else mesh["dp", "ep"]._flatten("stage", backend_override=override).get_group())
    pp_size = mesh.size(names.index("pp"))
    last = kind.num_stages(pp_size, stages_per_rank) - 1
    tied = tied_embedding_group(mesh, 0, kind.rank_of(last, pp_size, stages_per_rank), timeout)
    experts = mesh.get_group("ep") if "ep" in inside else None
    second = second_group(mesh, "ep") if overlap and experts is not None else None
    return PipelineGroups(mesh.get_group("pp"), data, experts, mesh.get_group("dp") if "dp" in inside else None,
                          tied, second)
