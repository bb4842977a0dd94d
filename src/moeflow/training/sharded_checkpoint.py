"""Sharded checkpoints with torch.distributed.checkpoint (DCP): no rank holds another rank's experts.

Every rank writes, in parallel, only what it holds: the replicated tensors are written once (DCP
spreads them over the ranks), and each expert or tensor-parallel parameter is written as the
chunks of its full (E, ...) tensor that the rank holds the primary copy of
(:meth:`~moeflow.parallel.ExpertPlacement.chunks`). DCP records every chunk's offsets, so a
loading rank asks for the chunks of its own placement (expert parallel on any W that divides E,
replicated, hidden-sharded for Tutel's r or Parm, packed, EPLB's slots) and reads only the bytes
that overlap them, straight into its parameters.

The chunks are described to DCP through its public planner interface (a save planner that adds a
write item per chunk, a load planner that adds read items with
:func:`~torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list`) rather than
as DTensors: a DeviceMesh places every expert alike, which EPLB's slots and the inference plan are
not, and the chunks describe regular and irregular placements the same way.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from moeflow.models import TrainableLM
from moeflow.parallel.placement import Chunk

METADATA = ".metadata"
"""DCP's index file: its presence marks a sharded checkpoint folder."""
MODEL = "model."
"""The key prefix of the model's tensors (its state-dict names follow)."""
OPTIMIZER = "optimizer."
"""The key prefix of AdamW's state: ``optimizer.<parameter>.<exp_avg|exp_avg_sq|step>``."""
MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter moments, placed like their parameter."""


@dataclass(frozen=True)
class PlacedTensor:
    """A tensor split over ranks, as the chunks this rank holds of its full shape."""

    full_shape: tuple[int, ...]
    chunks: list[Chunk]

    def chunk_at(self, offsets: tuple[int, ...]) -> torch.Tensor:
        for chunk in self.chunks:
            if chunk.offsets == offsets:
                return chunk.view
        raise KeyError(f"no chunk at {offsets}")


@dataclass
class ShardedState:
    """What DCP saves or loads for one rank: plain tensors (replicated: written once) by key, the
    placed tensors' chunks by key, and every key's local tensor."""

    plain: dict[str, torch.Tensor]
    placed: dict[str, PlacedTensor]
    local: dict[str, torch.Tensor]


def model_and_optimizer_state(
    model: TrainableLM, optimizer: torch.optim.Optimizer | None, first_copy: bool, primary_only: bool,
    optimizer_keys: set[str] | None = None,
) -> ShardedState:
    """This rank's model and AdamW state as DCP entries, views of the live tensors (loading writes
    into them in place). ``primary_only``: the chunks this rank writes when saving; otherwise all
    it holds. ``optimizer_keys``: when loading, the optimizer entries the checkpoint has (their
    tensors are created here and installed by :func:`install_optimizer_state`). The experts' chunks
    are this rank's in its expert group; where the expert groups are copies of each other
    (``--ep-size``), only the ``first_copy``'s ranks write them."""
    placed_params = model.placed_parameters()
    state = ShardedState({}, {}, {})
    expert_rank = model.groups.rank
    holds_primary = not primary_only or first_copy

    def add(key: str, name: str, tensor: torch.Tensor) -> None:
        state.local[key] = tensor
        if name in placed_params:
            sharding, kind = placed_params[name]
            chunks = sharding.chunks(kind, tensor, expert_rank, primary_only) if holds_primary else []
            state.placed[key] = PlacedTensor(tuple(sharding.full_shape(kind, tensor)), chunks)
        else:
            state.plain[key] = tensor

    for name, tensor in model.state_dict().items():
        add(MODEL + name, name, tensor)
    if optimizer is not None:
        for name, parameter in model.named_parameters():
            for entry, tensor in _optimizer_entries(optimizer, name, parameter, optimizer_keys):
                add(f"{OPTIMIZER}{name}.{entry}", name if entry in MOMENTS else "", tensor)
    return state


def _optimizer_entries(
    optimizer: torch.optim.Optimizer, name: str, parameter: torch.Tensor, keys: set[str] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(entry, tensor) of one parameter's AdamW state: the live state when saving, new tensors
    for the entries in ``keys`` when loading."""
    if keys is None:
        state = optimizer.state.get(parameter, {})
        for entry in (*MOMENTS, "step"):
            if entry in state:
                yield entry, torch.as_tensor(state[entry]).reshape(-1) if entry == "step" else state[entry]
        return
    if f"{OPTIMIZER}{name}.step" not in keys:
        return
    yield "step", torch.zeros(1, dtype=torch.float32)
    for moment in MOMENTS:
        yield moment, torch.zeros_like(parameter, memory_format=torch.contiguous_format)


def install_optimizer_state(model: TrainableLM, optimizer: torch.optim.Optimizer, state: ShardedState) -> None:
    """Put the loaded AdamW entries into ``optimizer.state``, as torch's AdamW keeps them."""
    for name, parameter in model.named_parameters():
        step = state.local.get(f"{OPTIMIZER}{name}.step")
        if step is not None:
            moments = {moment: state.local[f"{OPTIMIZER}{name}.{moment}"] for moment in MOMENTS}
            optimizer.state[parameter] = {"step": step.reshape(()).clone(), **moments}


def save_sharded(directory: Path, state: ShardedState, group: dist.ProcessGroup | None) -> None:
    """Write ``state`` into ``directory`` (a collective over ``group``: every rank calls it, each
    writing its own file; the coordinator writes DCP's index last)."""
    writer = dcp.FileSystemWriter(str(directory), sync_files=True, thread_count=1)
    with _single_process(group):
        dcp.save(state.plain, storage_writer=writer, planner=_ChunkSavePlanner(state.placed), process_group=group,
                 no_dist=group is None)


def load_sharded(directory: Path, state: ShardedState) -> None:
    """Fill ``state``'s tensors in place from a sharded checkpoint: each rank reads on its own
    (no collective) the bytes that overlap its chunks."""
    reader = dcp.FileSystemReader(str(directory))
    with _single_process(None):
        dcp.load(state.plain, storage_reader=reader, planner=_ChunkLoadPlanner(state.placed), no_dist=True)


def saved_tensors(directory: Path) -> dict[str, TensorStorageMetadata]:
    """The tensors a sharded checkpoint holds, by key: each one's full size and dtype."""
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key: md for key, md in saved.items() if isinstance(md, TensorStorageMetadata)}


def saved_keys(directory: Path) -> set[str]:
    """The keys a sharded checkpoint holds."""
    return set(saved_tensors(directory))


def read_full_tensors(directory: Path, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The full tensors of ``keys`` assembled from every rank's chunks, read in this process alone,
    one tensor per read: DCP's reader holds two transient copies of what one read asks for, so
    reading a layer's tensors together would hold two more copies of the layer."""
    saved = saved_tensors(directory)
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        if key not in saved:
            raise KeyError(f"the checkpoint {directory} has no tensor {key!r}")
        tensor = torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
        placed = {key: PlacedTensor(tuple(tensor.shape), [Chunk((0,) * tensor.dim(), tensor)])}
        load_sharded(directory, ShardedState({}, placed, {key: tensor}))
        tensors[key] = tensor
    return tensors


class _single_process(warnings.catch_warnings):
    """DCP warns that it assumes one process when told ``no_dist``, which is meant here."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.quiet = group is None

    def __enter__(self) -> None:
        super().__enter__()
        if self.quiet:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class _ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default planner plus one write item per chunk of each placed tensor."""

    def __init__(self, placed: dict[str, PlacedTensor]) -> None:
        super().__init__()
        self.placed = placed

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [_write_item(key, tensor, chunk) for key, tensor in self.placed.items() for chunk in tensor.chunks]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> object:
        if index.fqn in self.placed:
            return self.placed[index.fqn].chunk_at(tuple(index.offset)).detach()
        return super().lookup_object(index)


def _write_item(key: str, tensor: PlacedTensor, chunk: Chunk) -> WriteItem:
    offsets = torch.Size(chunk.offsets)
    return WriteItem(
        index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=chunk.view.shape),
            properties=TensorProperties.create_from_tensor(chunk.view), size=torch.Size(tensor.full_shape),
        ),
    )


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner plus the reads that fill each placed tensor's chunks (DCP computes
    which saved chunks overlap them: this is the resharding)."""

    def __init__(self, placed: dict[str, PlacedTensor]) -> None:
        super().__init__()
        self.placed = placed

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        items = []
        for key, tensor in self.placed.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if not isinstance(saved, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {key!r}: it was saved from another model")
            if tuple(saved.size) != tensor.full_shape:
                raise ValueError(
                    f"{key} has the full shape {tuple(saved.size)} in the checkpoint and {tensor.full_shape} in this "
                    "model: load it into a model of the same dimensions and number of experts"
                )
            chunks = [ChunkStorageMetadata(torch.Size(c.offsets), c.view.shape) for c in tensor.chunks]
            items += create_read_items_for_chunk_list(key, saved, chunks)
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.placed:
            return self.placed[index.fqn].chunk_at(tuple(index.offset)).detach()
        return super().lookup_tensor(index)
