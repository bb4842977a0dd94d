"""``moeflow train --hf DIR``: a transformers MoE model fine-tuned by moeflow's trainer.

The model's sparse blocks become moeflow layers (experts spread over the workers, tokens moved by
all-to-all); everything else (attention, norms, embeddings) is the transformers model's own and
runs data parallel, the attention's heads split over ``--mp-size`` workers where asked
(:mod:`moeflow.hf.tensor_parallel`). :class:`HFCausalLM` puts it behind the interface the trainer and its
checkpoints use (:class:`moeflow.models.TrainableLM`), so checkpoints, resume, metrics and the
report are the trainer's. At the end :func:`moeflow.training.hf_export.export_hf` writes a directory plain
transformers loads, from the last sharded checkpoint, one layer at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.comm.groups import ParallelGroups, group_size
from moeflow.data import PreparedCorpus, PretrainedTokenizer, prepare_corpus
from moeflow.hf.blocks import HFMoEBlock, moe_blocks
from moeflow.hf.families import family_for_model_type
from moeflow.hf.loading import check_model_dir, load_hf_model
from moeflow.hf.tensor_parallel import attention_split, split_attention
from moeflow.models.transformer import total_aux_loss
from moeflow.moe.layer import MoELayer
from moeflow.parallel.placement import PlacedParameter, expert_parallel_names
from moeflow.parallel.registry import (
    REPLICATING_SCHEDULES,
    check_techniques,
    experts_must_divide,
)
from moeflow.timing.phases import PhaseClock
from moeflow.training.config import MODEL_BALANCING, TrainConfig

TOKENIZER_FILE = "tokenizer.json"
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""The config keys transformers has named the expert count with."""
EXPERT_HIDDEN_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
"""The config keys of an expert's hidden size, the MoE-specific ones first (``intermediate_size``
is a dense MLP's where a family has both, and Mixtral's expert's where it has only that)."""


@dataclass(frozen=True)
class HFModelInfo:
    """What the launcher checks before any worker starts, read from ``config.json`` alone."""

    directory: str
    model_type: str
    num_experts: int
    vocab_size: int
    max_positions: int | None
    eos_token_id: int | None
    router_aux_loss_coef: float  # the config's coefficient of its balancing loss (0: none)
    adds_router_loss: bool  # whether the config turns that loss on (output_router_logits)
    expert_groups: int = 1  # the router's group-limited selection (DeepSeek-V3's n_group; 1: none)
    expert_hidden: int | None = None  # an expert's hidden size (None: the config names none we know)


def read_hf_info(path: str | Path) -> HFModelInfo:
    """From the model's config (transformers' own reading of it: key names differ across versions)."""
    import transformers

    directory = check_model_dir(path)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    family = family_for_model_type(config.model_type)
    num_experts = next((getattr(config, key) for key in EXPERT_COUNT_KEYS if getattr(config, key, None)), None)
    if num_experts is None:
        raise ValueError(f"the config of {str(path)!r} names no expert count ({', '.join(EXPERT_COUNT_KEYS)})")
    eos = config.eos_token_id
    adds_router_loss = bool(getattr(config, "output_router_logits", False))
    return HFModelInfo(
        directory=str(directory), model_type=config.model_type, num_experts=int(num_experts),
        vocab_size=int(config.vocab_size), max_positions=getattr(config, "max_position_embeddings", None),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        router_aux_loss_coef=float(getattr(config, "router_aux_loss_coef", None) or 0.0),
        adds_router_loss=adds_router_loss,
        expert_groups=int(getattr(config, "n_group", None) or 1) if family.grouped else 1,
        expert_hidden=next((int(getattr(config, key)) for key in EXPERT_HIDDEN_KEYS if getattr(config, key, None)),
                           None),
    )


def check_hf_training(config: TrainConfig, info: HFModelInfo) -> None:
    """The --hf run's own checks: the tokenizer, the experts over the workers, the context."""
    if not (Path(info.directory) / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(
            f"--hf {info.directory!r} has no {TOKENIZER_FILE}: fine-tuning tokenizes the corpus with the "
            "model's own (fast) tokenizer; save one with tokenizer.save_pretrained(DIR)"
        )
    if config.mp_size > 1:  # the heads first; the experts then over Parm's expert-parallel groups
        check_tensor_parallel_attention(config, info)
    over, name = config.expert_workers, config.expert_workers_setting
    if config.mp_size == 1 and experts_must_divide(config.parallel) and info.num_experts % over:
        raise ValueError(
            f"the model has {info.num_experts} experts per MoE block, not divisible by {name}={over}: use a "
            f"--{name.replace('_', '-')} that divides {info.num_experts}, or --parallel "
            f"{' or '.join(REPLICATING_SCHEDULES)}"
        )
    if config.topology_gate != "off" and info.expert_groups > 1:
        raise ValueError(f"--topology-gate limits the experts a token may pick, as the model's router already does "
                         f"(n_group={info.expert_groups}): use --topology-gate off with this model")
    moe = dataclasses.replace(config.model_config(info.vocab_size).moe, num_experts=info.num_experts)
    check_techniques(moe, config.layer_schedule(info.num_experts))
    config.check_expert_slots(info.num_experts)
    config.check_expert_packing(moe)
    if info.max_positions is not None and config.context > info.max_positions:
        raise ValueError(f"context={config.context} exceeds the model's max_position_embeddings="
                         f"{info.max_positions}; use --context {info.max_positions} or less")


def check_tensor_parallel_attention(config: TrainConfig, info: HFModelInfo) -> None:
    """--mp-size N on a --hf model: its attention splits by its own plan over N, its experts over
    Parm's expert-parallel groups."""
    import transformers

    attention_split(transformers.AutoConfig.from_pretrained(info.directory, local_files_only=True), config.mp_size)
    config.check_expert_shards(info.num_experts, info.expert_hidden)


def prepare_hf_corpus(config: TrainConfig, cache_root: Path) -> PreparedCorpus:
    """The trainer's corpus tokenized with the model's own tokenizer, documents ended by its EOS."""
    assert config.hf is not None
    info = read_hf_info(config.hf)
    check_hf_training(config, info)
    tokenizer = PretrainedTokenizer(str(Path(info.directory) / TOKENIZER_FILE), info.eos_token_id)
    corpus = prepare_corpus(config.data, val_percent=config.val_percent, cache_root=cache_root, pretrained=tokenizer)
    if corpus.vocab_size > info.vocab_size:
        raise ValueError(f"the tokenizer of {info.directory!r} has {corpus.vocab_size} tokens, more than the "
                         f"model's vocab_size={info.vocab_size}: the model cannot embed them")
    return corpus


def model_settings(config: TrainConfig, info: HFModelInfo) -> dict[str, dict[str, Any]]:
    """The MoE settings a --hf run takes from the model unless given, each with its value and where
    it came from (what the run's config.json records beside the learning rates). The balancing
    loss is the model's own weight when its config turns the loss on, or when the user does
    (``--aux-loss-weight model``)."""
    return {"aux_loss_weight": _balancing(config, info), "capacity_factor": _capacity(config)}


def _balancing(config: TrainConfig, info: HFModelInfo) -> dict[str, Any]:
    coefficient = info.router_aux_loss_coef
    if config.aux_loss_weight == MODEL_BALANCING:
        if not coefficient:
            raise ValueError(f"--aux-loss-weight {MODEL_BALANCING} takes the model's router_aux_loss_coef, and the "
                             f"config of {info.directory!r} sets none: give a number, e.g. --aux-loss-weight 0.001")
        return {"value": coefficient, "from": f"the model's router_aux_loss_coef (--aux-loss-weight {MODEL_BALANCING})"}
    if config.aux_loss_weight is not None:
        return {"value": float(config.aux_loss_weight), "from": "--aux-loss-weight"}
    if info.adds_router_loss and coefficient:
        return {"value": coefficient, "from": "the model's router_aux_loss_coef (its config sets output_router_logits)"}
    return {"value": 0.0, "from": f"the model's config (output_router_logits off: no balancing loss; "
            f"--aux-loss-weight {MODEL_BALANCING} turns on the model's own)"}


def _capacity(config: TrainConfig) -> dict[str, Any]:
    if config.capacity_factor is not None:
        return {"value": config.capacity_factor, "from": "--capacity-factor"}
    return {"value": 0.0, "from": "dropless, as the model was trained"}


def layer_options(config: TrainConfig, info: HFModelInfo) -> dict[str, Any]:
    """The MoE layers' settings from the trainer's: unset ones keep the model's own
    (:func:`model_settings`); the trainer's expert kernel (``auto`` by default: per call the faster
    of ``bmm`` and ``ragged``, ``bmm`` under Parm's schedules, which tensor-parallel attention runs)."""
    from_model = model_settings(config, info)
    return {
        "pipeline": config.pipeline, "alltoall": config.alltoall, "parallel": config.parallel,
        "token_exchange": config.token_exchange, "wire_dtype": config.wire_dtype, "profile": config.profile,
        "tokens_per_rank_hint": config.batch_size * config.context,
        "aux_loss_weight": from_model["aux_loss_weight"]["value"],
        "capacity_factor": from_model["capacity_factor"]["value"],
        "expert_kernel": config.expert_kernel,
        "shadowing": config.shadowing, "topology_gate": config.topology_gate,
        "redundant_experts": config.redundant_experts, "balance": config.balance,
    }


class HFCausalLM(nn.Module):
    """A converted transformers causal LM behind the trainer's model interface:
    ``forward(idx, targets)`` returns (logits, loss), the loss being the mean cross-entropy plus the
    MoE layers' router losses."""

    def __init__(self, model: nn.Module, groups: ParallelGroups, eval_capacity_factor: float,
                 attention_shards: dict[str, PlacedParameter] | None = None) -> None:
        super().__init__()
        self.model = model
        self.attention_shards = {f"model.{name}": placed for name, placed in (attention_shards or {}).items()}
        self.groups = groups
        self.clock = PhaseClock(enabled=False)
        self.last_lm_loss: torch.Tensor | None = None
        for block in moe_blocks(model):
            block.clock = self.clock
            block.eval_capacity_factor = eval_capacity_factor
        for index, layer in zip(self.moe_block_indices(), self.moe_layers(), strict=True):
            layer.index = index  # what a hang report calls it (the decoder layer's number)

    def _named_blocks(self) -> list[tuple[str, HFMoEBlock]]:
        return [(name, module) for name, module in self.named_modules() if isinstance(module, HFMoEBlock)]

    def moe_layers(self) -> list[MoELayer]:
        return [block.moe for _, block in self._named_blocks()]

    def moe_block_indices(self) -> list[int]:
        """The decoder layer of each MoE block (the number in its module path)."""
        return [next(int(part) for part in name.split(".") if part.isdigit()) for name, _ in self._named_blocks()]

    def placed_parameters(self) -> dict[str, PlacedParameter]:
        experts = {f"{name}.moe.experts.{kind}": PlacedParameter(block.moe.placement, kind)
                   for name, block in self._named_blocks() for kind, _ in block.moe.experts.named_parameters()}
        return experts | self.attention_shards

    def expert_parameter_names(self) -> set[str]:
        return expert_parallel_names(self.placed_parameters())

    def tensor_parallel_parameter_names(self) -> set[str]:
        """The attention's tensors split over the MP group (--mp-size; none without it)."""
        return set(self.attention_shards)

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits_BTV = self.model(input_ids=idx_BT, use_cache=False).logits
        if targets_BT is None:
            return logits_BTV, None
        lm_loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
        self.last_lm_loss = lm_loss.detach()
        return logits_BTV, lm_loss + total_aux_loss(self.moe_layers(), lm_loss)


def build_hf_model(config: TrainConfig, groups: ParallelGroups, device: torch.device) -> HFCausalLM:
    """The --hf model in fp32 with this rank's experts (each rank reads only its own from the checkpoint)."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # the worker's own setting: the trainer shows the progress
    assert config.hf is not None
    info = read_hf_info(config.hf)
    model = load_hf_model(config.hf, "float32", groups, **layer_options(config, info))
    shards = split_attention(model, groups.model, groups.size) if group_size(groups.model) > 1 else None
    return HFCausalLM(model.to(device), groups, config.eval_capacity_factor, shards)
