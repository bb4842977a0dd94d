"""A model's pipeline on this rank: its part of the model, its stages, torch's schedule over them,
and one training step.

    mesh = init_device_mesh("cpu", (pp, dp, ep), mesh_dim_names=("pp", "dp", "ep"))
    pipeline = pipeline_stages(config, mesh, schedule="1f1b", microbatches=4, batch_size=8)
    optimizer = torch.optim.AdamW(pipeline.parameters())
    loss = pipeline.step(idx_BT, targets_BT)   # forward and backward of every micro-batch
    pipeline.clip_gradients(1.0)
    optimizer.step()

Every rank of the mesh calls :func:`pipeline_stages` together (it makes the pipeline's groups).
A rank builds only the blocks of its own stages; ``pipeline.parameters()`` are those.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from moeflow.comm.collectives import flat_sum, reduce_values
from moeflow.comm.groups import ParallelGroups
from moeflow.models.model_part import ModelPart
from moeflow.models.transformer import MoETransformer, TransformerConfig
from moeflow.moe.layer import MoELayer
from moeflow.pipeline.groups import PipelineGroups, check_mesh, pipeline_groups
from moeflow.pipeline.layout import PipelineSchedule, schedule_named
from moeflow.pipeline.schedules import build_runtime
from moeflow.pipeline.split import StageSplit
from moeflow.pipeline.stage import TransformerStage
from moeflow.pipeline.tied import sum_tied_gradients


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean next-token cross-entropy (the last stage's loss function)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())


@dataclass
class Pipeline:
    """This rank's part of a pipelined model, its stages and the schedule that runs them."""

    model: MoETransformer  # this rank's part (:class:`~moeflow.models.model_part.ModelPart`)
    stages: list[TransformerStage]
    schedule: PipelineSchedule
    runtime: object
    groups: PipelineGroups
    microbatches: int
    expert_names: frozenset[str]  # the expert-parallel parameters (their gradients sum the group's tokens)
    torch_stages: list[PipelineStage]  # torch's stage over each of ``stages``: what the runtime's actions call

    @property
    def holds_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def holds_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names, each once."""
        return self.model.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once: what its optimizer takes."""
        return self.model.parameters()

    def moe_layers(self) -> list[MoELayer]:
        return self.model.moe_layers()

    def step(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """One forward and backward of the whole batch in micro-batches; the gradients are then
        those of the mean loss over the micro-batches and the stage's data ranks (language model
        plus every stage's aux losses), the tied embedding's summed over its copies, and the
        loss-free balancing bias moved once, from the whole step's load. Returns that loss, on
        every rank. Every rank of a pipeline passes the same batch (the first stage reads the ids,
        the last the targets)."""
        losses: list[torch.Tensor] = []
        inputs = (idx_BT,) if self.holds_first else ()
        for layer in self.moe_layers():
            layer.hold_bias_updates()
        self.runtime.step(*inputs, target=targets_BT if self.holds_last else None, losses=losses)
        for layer in self.moe_layers():
            layer.release_bias_updates(self.groups.replicas)
        self._mean_gradients()
        lm = float(torch.stack(losses).detach().mean()) if losses else 0.0
        aux = sum(float(stage.take_aux_losses()) for stage in self.stages)
        return self._mean_over_pipelines(lm + aux)

    @torch.no_grad()
    def evaluate(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """The mean language-model loss of a batch, forward only and in eval mode (no capacity
        drop unless the config's evaluation factor asks), on every rank."""
        losses: list[torch.Tensor] = []
        modules = [self.model, *self.stages]  # a stage's own mode picks the evaluation's capacity factor
        for module in modules:
            module.eval()
        try:
            self.runtime.eval(*((idx_BT,) if self.holds_first else ()),
                              target=targets_BT if self.holds_last else None, losses=losses)
        finally:
            for module in modules:
                module.train()
            for stage in self.stages:
                stage.take_aux_losses()
        return self._mean_over_pipelines(float(torch.stack(losses).mean()) if losses else 0.0)

    def clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient so that the whole model's gradient norm, over every stage and
        expert, is at most ``max_norm`` (0: no clipping; torch's formula); returns that norm."""
        replicated_sq = expert_sq = 0.0
        for name, parameter in self.named_parameters():
            if parameter.grad is None or (name.startswith("token_embedding.") and not self.model.part.embeddings):
                continue  # the tied embedding's copy on the last stage is counted on the first
            if name in self.expert_names:
                expert_sq += float(parameter.grad.pow(2).sum()) if self.groups.counts_experts else 0.0
            elif self.groups.counts_replicated:
                replicated_sq += float(parameter.grad.pow(2).sum())
        stage_sums = reduce_values([replicated_sq, expert_sq], self.groups.pp)
        norm = math.sqrt(sum(reduce_values(stage_sums, self.groups.data) if self.groups.data else stage_sums))
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(list(self.parameters()), max_norm, torch.tensor(norm))
        return norm

    def _mean_over_pipelines(self, own_share: float) -> float:
        """A value each stage holds a share of, summed over the stages and averaged over the
        stage's data ranks."""
        total = sum(reduce_values([own_share], self.groups.pp))
        size = self.groups.data_size
        return total if size == 1 else reduce_values([total], self.groups.data)[0] / size

    def _mean_gradients(self) -> None:
        """The gradients of the mean loss over the micro-batches and the stage's data ranks: each
        divided once by both counts (torch's per-stage scaling would divide a parameter two
        stages share twice), the tied embedding's copies summed, the replicated parameters' summed
        over the data ranks and the experts' over their copies, each in one flat all-reduce."""
        size = self.groups.data_size
        replicated, experts = [], []
        for name, parameter in self.named_parameters():
            if parameter.grad is None:
                if size == 1:
                    continue
                parameter.grad = torch.zeros_like(parameter)  # every rank adds the same flat tensor
            parameter.grad.div_(self.microbatches * size)
            (experts if name in self.expert_names else replicated).append(parameter.grad)
        sum_tied_gradients(self.model.token_embedding.weight if self.model.token_embedding else None,
                           self.groups.tied)
        flat_sum(replicated, self.groups.data)
        flat_sum(experts, self.groups.replicas)


def pipeline_stages(
    config: TransformerConfig, mesh: DeviceMesh, schedule: str = "1f1b", microbatches: int = 4,
    batch_size: int = 8, seq_len: int | None = None, split: Sequence[int] | None = None, stages_per_rank: int = 2,
    seed: int = 0, expert_groups: ParallelGroups | None = None, device: torch.device | None = None,
    activation_checkpointing: bool = False, overlap: bool | None = None,
) -> Pipeline:
    """This rank's stages of a :class:`MoETransformer` of ``config`` (initialised from ``seed`` as
    the whole model would be) over ``mesh``'s ``pp`` dimension under ``schedule`` (``gpipe``,
    ``1f1b``, ``interleaved``, ``zbv``, ``dualpipev``): the blocks ``split`` over the stages (evenly
    by default), ``batch_size`` sequences of ``seq_len`` (the model's context) a step and data rank,
    in ``microbatches`` micro-batches. ``expert_groups``: the MoE layers' groups over the mesh's
    ``ep`` dimension with a topology and a ledger (made from the mesh when not given);
    ``activation_checkpointing``: every block's activations recomputed in the backward;
    ``overlap``: under a schedule that pairs one micro-batch's forward with another's backward
    (``dualpipev``), run the two side by side, each one's all-to-alls beside the other's compute
    (None: wherever the stages have an expert group to wait on; :mod:`moeflow.pipeline.overlap`)."""
    kind = schedule_named(schedule)
    check_mesh(mesh)
    overlap = _overlaps(kind, mesh, overlap)
    if batch_size % microbatches:
        raise ValueError(f"batch_size={batch_size} must split into microbatches={microbatches} equal micro-batches; "
                         "choose a batch size that the number of micro-batches divides")
    groups = pipeline_groups(mesh, kind, stages_per_rank, overlap)
    pp_rank, pp_size = mesh.get_local_rank("pp"), mesh.size(mesh.mesh_dim_names.index("pp"))
    num_stages = kind.num_stages(pp_size, stages_per_rank)
    stage_split = StageSplit.of(config.layers, num_stages, split)
    indices = kind.stage_indices(pp_rank, pp_size, stages_per_rank)
    part = ModelPart.of_stages([stage_split.blocks[index] for index in indices], 0 in indices,
                               num_stages - 1 in indices)
    device = device or _mesh_device(mesh)
    expert_groups = expert_groups or (ParallelGroups.from_group(groups.experts) if groups.experts is not None
                                      else ParallelGroups.single_process())
    second = {} if groups.second_experts is None else dict.fromkeys(  # the V's second stage: the other lane
        stage_split.blocks[indices[1]], expert_groups.over(groups.second_experts))
    model = MoETransformer(config, group=expert_groups, seed=seed, part=part, block_groups=second).to(device)
    shape = (batch_size // microbatches, seq_len or config.context)
    stages = [TransformerStage(model, index, stage_split, activation_checkpointing, microbatches)
              for index in indices]
    wrapped = [PipelineStage(stage, stage.index, num_stages, device, input_args=_example_input(stage, shape, device),
                             output_args=_example_output(stage, shape, device), group=groups.pp)
               for stage in stages]
    runtime = build_runtime(kind, wrapped, microbatches, lm_loss, overlap)
    return Pipeline(model, stages, kind, runtime, groups, microbatches, frozenset(model.expert_parameter_names()),
                    wrapped)


def _overlaps(kind: PipelineSchedule, mesh: DeviceMesh, overlap: bool | None) -> bool:
    """Whether the pipeline runs its paired forwards and backwards side by side."""
    if overlap and not kind.pairs_forward_backward:
        raise ValueError(f"overlap=True needs a schedule that pairs a forward with a backward (dualpipev); "
                         f"{kind.name!r} runs one action at a time: pass overlap=None or False")
    if overlap is None:
        names = mesh.mesh_dim_names or ()
        return kind.pairs_forward_backward and "ep" in names and mesh.size(names.index("ep")) > 1
    return overlap


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _example_input(stage: TransformerStage, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """What the stage takes for one micro-batch (its shape and dtype are what the schedule needs)."""
    if stage.is_first:
        return torch.zeros(shape, dtype=torch.long, device=device)
    return torch.zeros((*shape, stage.config.model_dim), device=device, requires_grad=True)  # its gradient goes back


def _example_output(stage: TransformerStage, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    width = stage.config.vocab_size if stage.is_last else stage.config.model_dim
    return torch.zeros((*shape, width), device=device, requires_grad=True)
