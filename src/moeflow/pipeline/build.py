"""A model's pipeline on this rank: its stages, torch's schedule over them, and one training step.

    mesh = init_device_mesh("cpu", (pp, ep), mesh_dim_names=("pp", "ep"))
    model = MoETransformer(config, group=mesh.get_group("ep"))
    pipeline = pipeline_stages(model, mesh, schedule="1f1b", microbatches=4, batch_size=8)
    loss = pipeline.step(idx_BT, targets_BT)   # forward and backward; then optimizer.step()

Every rank of the mesh calls :func:`pipeline_stages` together (it makes the tied embedding's
groups). ``pipeline.parameters()`` are this rank's stages' (what its optimizer takes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from moeflow.comm.collectives import flat_sum, reduce_values
from moeflow.comm.groups import group_size
from moeflow.models.transformer import MoETransformer
from moeflow.pipeline.schedules import PipelineSchedule, build_runtime, schedule_named
from moeflow.pipeline.split import StageSplit
from moeflow.pipeline.stage import TransformerStage
from moeflow.pipeline.tied import sum_tied_gradients, tied_embedding_group


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean next-token cross-entropy (the last stage's loss function)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())


@dataclass
class Pipeline:
    """This rank's stages of a pipelined model and the schedule that runs them."""

    stages: list[TransformerStage]
    schedule: PipelineSchedule
    runtime: object
    pp_group: dist.ProcessGroup
    tied_group: dist.ProcessGroup | None
    microbatches: int
    data_group: dist.ProcessGroup | None  # the stage's expert group, whose ranks read different batches
    expert_names: frozenset[str]  # the expert-parallel parameters (their gradients sum the group's tokens)

    @property
    def holds_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def holds_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names, each once (a V schedule's two stages
        share the tied embedding)."""
        seen: set[int] = set()
        for stage in self.stages:
            for name, parameter in stage.named_parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield name, parameter

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once: what its optimizer takes."""
        return (parameter for _, parameter in self.named_parameters())

    def step(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """One forward and backward of the whole batch in micro-batches; the gradients are then
        those of the mean loss over the micro-batches (language model plus every stage's aux
        losses), the tied embedding's summed over its copies. Returns that loss, on every rank.
        Every rank of the pipeline passes the same batch (the first stage reads the ids, the last
        the targets)."""
        losses: list[torch.Tensor] = []
        inputs = (idx_BT,) if self.holds_first else ()
        self.runtime.step(*inputs, target=targets_BT if self.holds_last else None, losses=losses)
        self._mean_gradients()
        lm = float(torch.stack(losses).detach().mean()) if losses else 0.0
        aux = sum(float(stage.take_aux_losses()) for stage in self.stages)
        loss = sum(reduce_values([lm, aux], self.pp_group))
        size = group_size(self.data_group)
        return loss if size == 1 else reduce_values([loss], self.data_group)[0] / size

    def _mean_gradients(self) -> None:
        """The gradients of the mean loss over the micro-batches and the expert group's ranks (which
        read different batches): each parameter's divided once by both counts (torch's per-stage
        scaling would divide a parameter two stages share twice), the tied embedding's copies
        summed, the replicated parameters' summed over the group in one all-reduce. The experts'
        already sum every rank's tokens, through the all-to-all's backward."""
        size = group_size(self.data_group)
        replicated = []
        for name, parameter in self.named_parameters():
            if parameter.grad is None:
                if size == 1:
                    continue
                parameter.grad = torch.zeros_like(parameter)  # every rank adds the same flat tensor
            parameter.grad.div_(self.microbatches * size)
            if size > 1 and name not in self.expert_names:
                replicated.append(parameter.grad)
        sum_tied_gradients(self._tied_weight(), self.tied_group)
        flat_sum(replicated, self.data_group)

    def _tied_weight(self) -> nn.Parameter | None:
        for stage in self.stages:
            if stage.token_embedding is not None:
                return stage.token_embedding.weight
        return None


def pipeline_stages(
    model: MoETransformer, mesh: DeviceMesh, schedule: str = "1f1b", microbatches: int = 4, batch_size: int = 8,
    seq_len: int | None = None, split: Sequence[int] | None = None, stages_per_rank: int = 2,
) -> Pipeline:
    """This rank's stages of ``model`` over ``mesh``'s ``pp`` dimension under ``schedule``
    (``gpipe``, ``1f1b``, ``interleaved``, ``zbv``, ``dualpipev``): the blocks ``split`` over the
    stages (evenly by default), ``batch_size`` sequences of ``seq_len`` (the model's context) a
    step in ``microbatches`` micro-batches."""
    kind = schedule_named(schedule)
    _check_mesh(mesh)
    if batch_size % microbatches:
        raise ValueError(f"batch_size={batch_size} must split into microbatches={microbatches} equal micro-batches; "
                         "choose a batch size that the number of micro-batches divides")
    pp_group = mesh.get_group("pp")
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    num_stages = kind.num_stages(pp_size, stages_per_rank)
    stage_split = StageSplit.of(model.config.layers, num_stages, split)
    indices = kind.stage_indices(pp_rank, pp_size, stages_per_rank)
    tied = tied_embedding_group(mesh, 0, _rank_of_stage(kind, num_stages - 1, pp_size, stages_per_rank))
    device = next(model.parameters()).device
    shape = (batch_size // microbatches, seq_len or model.config.context)
    stages = [TransformerStage(model, index, stage_split) for index in indices]
    wrapped = [PipelineStage(stage, stage.index, num_stages, device, input_args=_example_input(stage, shape, device),
                             output_args=_example_output(stage, shape, device), group=pp_group)
               for stage in stages]
    runtime = build_runtime(kind, wrapped, microbatches, lm_loss)
    data_group = mesh.get_group("ep") if "ep" in mesh.mesh_dim_names else None
    return Pipeline(stages, kind, runtime, pp_group, tied, microbatches, data_group,
                    frozenset(model.expert_parameter_names()))


def _check_mesh(mesh: DeviceMesh) -> None:
    """A (pp,) or (pp, ep) mesh: data parallelism beside expert parallelism inside a stage comes later."""
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or set(names) - {"pp", "ep"}:
        raise ValueError(f"pipeline_stages takes a mesh with dimensions ('pp',) or ('pp', 'ep'), got {names}: "
                         "init_device_mesh(device, (pp, ep), mesh_dim_names=('pp', 'ep'))")


def _rank_of_stage(kind: PipelineSchedule, stage: int, pp_size: int, stages_per_rank: int) -> int:
    return next(rank for rank in range(pp_size) if stage in kind.stage_indices(rank, pp_size, stages_per_rank))


def _example_input(stage: TransformerStage, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """What the stage takes for one micro-batch (its shape and dtype are what the schedule needs)."""
    if stage.is_first:
        return torch.zeros(shape, dtype=torch.long, device=device)
    return torch.zeros((*shape, stage.config.model_dim), device=device, requires_grad=True)  # its gradient goes back


def _example_output(stage: TransformerStage, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    width = stage.config.vocab_size if stage.is_last else stage.config.model_dim
    return torch.zeros((*shape, width), device=device, requires_grad=True)
