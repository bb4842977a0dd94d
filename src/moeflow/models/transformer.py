"""A decoder-only MoE transformer in the style of nanoGPT, built on :class:`~moeflow.MoELayer`.

Reads top to bottom: config, attention, dense FFN, block, model. Pre-LayerNorm blocks, causal
self-attention, an MoE feed-forward in every ``moe_every``-th block (a dense FFN elsewhere), tied
input/output embeddings. Every MoE layer's aux loss is added to the language-model loss.

Experts are placed by each MoE layer's schedule (expert parallel: each rank holds E / W of them;
replicated: all of them); every other parameter, and replicated experts, are kept equal by a
gradient all-reduce in the trainer. Shapes: B batch,
T positions, M model dim, V vocabulary, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow.comm.groups import ParallelGroups, group_size
from moeflow.comm.mp import copy_to_region, reduce_from_region
from moeflow.config import (
    MODEL_MOE_DEFAULTS,
    MoEConfig,
    require_positive_int,
    validate_capacity_factor,
)
from moeflow.core.clamped_swiglu import clamp_of
from moeflow.core.experts import ExpertFFN
from moeflow.core.workspace import share_workspace
from moeflow.kernels.choice import share_kernel_table
from moeflow.models.model_part import AbsentBlock, ModelPart
from moeflow.models.tensor_parallel import TENSOR_PARALLEL_KINDS, HeadShards
from moeflow.moe.layer import MoELayer
from moeflow.parallel.placement import PlacedParameter, expert_parallel_names
from moeflow.timing.phases import PhaseClock

if TYPE_CHECKING:
    from moeflow.models.interface import TrainableLM


@dataclass(frozen=True)
class TransformerConfig:
    """The architecture. The MoE layers' settings are the layer's own :class:`MoEConfig` (its model
    and hidden dimensions are the model's, and every FFN's, dense ones included); ``moe_every=1``
    puts an MoE FFN in every block, 2 in every other block (blocks 1, 3, ..., as in GShard and
    Switch). :meth:`build` takes the flat names the trainer and its flags use."""

    vocab_size: int
    moe: MoEConfig
    context: int = 128
    layers: int = 4
    heads: int = 4
    moe_every: int = 1
    eval_capacity_factor: float = 0.0  # 0: no token is dropped at evaluation (batch-independent)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "layers", "heads", "moe_every"):
            require_positive_int(name, getattr(self, name))
        if self.model_dim % self.heads:
            raise ValueError(
                f"model_dim={self.model_dim} is not divisible by heads={self.heads}; "
                "choose heads that divide model_dim"
            )
        validate_capacity_factor(self.eval_capacity_factor)

    @classmethod
    def build(cls, **values: Any) -> TransformerConfig:
        """From flat settings: the architecture's own names and MoEConfig's names; MoE settings not
        given take ``moeflow.config.MODEL_MOE_DEFAULTS``."""
        own = {f.name for f in fields(cls)} - {"moe"}
        moe_names = {f.name for f in fields(MoEConfig)}
        unknown = sorted(set(values) - own - moe_names)
        if unknown:
            raise ValueError(f"unknown model setting(s) {unknown}")
        moe = MoEConfig(**{**MODEL_MOE_DEFAULTS, **{k: v for k, v in values.items() if k in moe_names}})
        return cls(moe=moe, **{k: v for k, v in values.items() if k in own})

    @property
    def model_dim(self) -> int:
        return self.moe.model_dim

    def is_moe_block(self, index: int) -> bool:
        return index % self.moe_every == self.moe_every - 1

    @property
    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.layers) if self.is_moe_block(i)]

    def active_parameters(self) -> int:
        """Parameters one token passes through: attention, dense FFNs, the router and k experts of
        each MoE layer, and the (tied) output head; position embeddings are a lookup, not counted."""
        moe, m = self.moe, self.model_dim
        ffn = moe.dims.expert_parameters  # every FFN, dense ones included, has the experts' shape
        attention = 4 * m * m + 4 * m
        norms = 4 * m
        moe_blocks = len(self.moe_blocks)
        dense_blocks = self.layers - moe_blocks
        per_moe = moe.num_experts * m + moe.top_k * ffn
        return (self.layers * (attention + norms) + dense_blocks * ffn + moe_blocks * per_moe
                + 2 * m + self.vocab_size * m)

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward and backward (nanoGPT / PaLM appendix B): 6 N for the
        matmuls with N active parameters, plus 12 L T M for the attention scores and values."""
        return 6.0 * self.active_parameters() + 12.0 * self.layers * self.context * self.model_dim


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention; with an ``mp_group`` of N ranks, tensor parallel: this member
    runs heads / N of the heads on the (replicated) input, and one all-reduce sums the members'
    output projections (Megatron's column- then row-parallel pair)."""

    def __init__(self, config: TransformerConfig, mp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        members = group_size(mp_group)
        if config.heads % members:
            raise ValueError(
                f"heads={config.heads} cannot be split over mp_size={members} tensor-parallel ranks; "
                "use an mp_size that divides the heads"
            )
        self.mp_group = mp_group if members > 1 else None
        self.heads, local_dim = config.heads // members, config.model_dim // members
        self.qkv = nn.Linear(config.model_dim, 3 * local_dim)
        self.proj = nn.Linear(local_dim, config.model_dim)

    def forward(self, x_BTM: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTM.shape
        if self.mp_group is not None:
            x_BTM = copy_to_region(x_BTM, self.mp_group)
        local_dim = self.proj.in_features
        q, k, v = self.qkv(x_BTM).split(local_dim, dim=2)
        shape = (b, t, self.heads, local_dim // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = F.linear(y.transpose(1, 2).reshape(b, t, local_dim), self.proj.weight)
        if self.mp_group is not None:
            out = reduce_from_region(out, self.mp_group)
        return out + self.proj.bias


class DenseFFN(ExpertFFN):
    """The FFN of a dense block: one expert that every token passes through (the experts' own FFN,
    so every activation, swiglu included, means the same in dense and MoE blocks)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(1, config.model_dim, config.moe.hidden_dim, config.moe.activation, bias=config.moe.bias,
                         clamp=clamp_of(config.moe))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(1, -1, x.shape[-1])).view(x.shape)


class Block(nn.Module):
    """Pre-LayerNorm block: x + attention(ln(x)), then x + ffn(ln(x)), the FFN dense or MoE."""

    def __init__(
        self, config: TransformerConfig, moe: bool, groups: ParallelGroups, profile: str | None
    ) -> None:
        super().__init__()
        self.ln_attention = nn.LayerNorm(config.model_dim)
        self.attention = CausalSelfAttention(config, groups.model)
        self.ln_ffn = nn.LayerNorm(config.model_dim)
        self.ffn: MoELayer | DenseFFN = (
            MoELayer.from_config(config.moe, groups, profile) if moe else DenseFFN(config)
        )

    @property
    def moe(self) -> MoELayer | None:
        return self.ffn if isinstance(self.ffn, MoELayer) else None

    def forward(self, x: torch.Tensor, clock: PhaseClock, capacity_factor: float | None) -> torch.Tensor:
        x = x + clock.around("attention", x, lambda h: self.attention(self.ln_attention(h)))
        moe = self.moe
        if moe is None:
            return x + clock.around("dense_ffn", x, lambda h: self.ffn(self.ln_ffn(h)))
        return x + clock.around("moe", x, lambda h: moe(self.ln_ffn(h), capacity_factor=capacity_factor))


def _by_lane(layers: list[MoELayer]) -> list[list[MoELayer]]:
    """``layers`` grouped by the ParallelGroups they communicate over, in order of first use."""
    lanes: dict[int, list[MoELayer]] = {}
    for layer in layers:
        lanes.setdefault(id(layer.groups), []).append(layer)
    return list(lanes.values())


class MoETransformer(nn.Module):
    """The language model. ``forward(idx, targets)`` returns (logits, loss) where loss is the mean
    cross-entropy of the targets plus the sum of the MoE aux losses (``None`` without targets)."""

    def __init__(
        self, config: TransformerConfig, group: ParallelGroups | dist.ProcessGroup | None = None, seed: int = 0,
        profile: str | None = None, part: ModelPart | None = None,
        block_groups: Mapping[int, ParallelGroups] | None = None,
    ) -> None:
        """``part``: only those blocks and ends (a pipeline rank's stages); the rest is absent, no
        parameter of it made, and what is held is initialised as in the whole model.
        ``block_groups``: other groups for some blocks (a second lane, :meth:`ParallelGroups.over`:
        those blocks may run in another thread beside the others, with buffers of their own)."""
        super().__init__()
        self.config, self.part, self.profile = config, part or ModelPart.whole(config.layers), profile
        groups = group if isinstance(group, ParallelGroups) else ParallelGroups.from_group(group)
        self.groups = groups
        lanes = block_groups or {}
        self.token_embedding = nn.Embedding(config.vocab_size, config.model_dim) if self.part.token_embedding else None
        self.position_embedding = nn.Embedding(config.context, config.model_dim) if self.part.embeddings else None
        self.blocks = nn.ModuleList(
            Block(config, config.is_moe_block(i), lanes.get(i, groups), profile) if i in self.part.blocks
            else AbsentBlock(i) for i in range(config.layers)
        )
        self.ln_final = nn.LayerNorm(config.model_dim) if self.part.head else None
        for lane in _by_lane(self.moe_layers()):
            share_workspace(lane)  # one set of backward buffers for all the layers of a lane
            share_kernel_table(lane)  # kernel_backend="auto" measures once for all of them
        for index, layer in zip(self.moe_block_indices(), self.moe_layers(), strict=True):
            layer.index = index  # what a hang report calls it
        self.clock = PhaseClock(enabled=False)
        self.last_lm_loss: torch.Tensor | None = None
        self._initialize(seed)

    # -- structure --------------------------------------------------------------------------------

    def moe_layers(self) -> list[MoELayer]:
        return [block.moe for block in self.blocks if block.moe is not None]

    def moe_block_indices(self) -> list[int]:
        """The block number of each of :meth:`moe_layers`."""
        return [index for index in self.config.moe_blocks if index in self.part.blocks]

    def placed_parameters(self) -> dict[str, PlacedParameter]:
        """Every expert parameter's placement and kind (``w1``, ``b1``, ...) and every
        tensor-parallel attention parameter's head layout and kind, by name: what the checkpoints
        slice and assemble full tensors with."""
        placed: dict[str, PlacedParameter] = {
            f"blocks.{i}.ffn.experts.{name}": PlacedParameter(block.moe.placement, name)
            for i, block in enumerate(self.blocks) if block.moe is not None
            for name, _ in block.moe.experts.named_parameters()
        }
        return placed | self._head_shards()

    def _head_shards(self) -> dict[str, PlacedParameter]:
        members = group_size(self.groups.model)
        if members == 1:
            return {}
        shards = HeadShards(self.groups.size, members, self.config.model_dim)
        return {f"blocks.{i}.attention.{kind}": PlacedParameter(shards, kind) for i in range(self.config.layers)
                for kind in TENSOR_PARALLEL_KINDS}

    def expert_parameter_names(self) -> set[str]:
        """Parameters whose ranks hold different parts (expert parallel): their gradients already
        sum every rank's tokens, so the trainer does not all-reduce them. Replicated experts are
        ordinary replicated parameters."""
        return expert_parallel_names(self.placed_parameters())

    def tensor_parallel_parameter_names(self) -> set[str]:
        """Attention parameters split over the MP group: the trainer averages them over the
        data-parallel replicas of the same heads only."""
        return set(self._head_shards())

    # -- initialization ---------------------------------------------------------------------------

    def _initialize(self, seed: int) -> None:
        """GPT-2 initialization from one seed, the same on every rank and for any number of ranks:
        each MoE layer draws expert e from the layer's seed and e (only this rank's experts), so a
        model is the same function whether it runs on 1 or W workers. A part draws what it does
        not hold too (one tensor at a time, then dropped; no expert), so that it holds what the
        whole model would."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        heads = self._head_shards()
        with torch.no_grad():
            for name, parameter in self._parameters_in_drawing_order():
                held = not parameter.is_meta
                if _is_expert_parameter(name):
                    continue
                if parameter.dim() == 1 or name.endswith((".b1", ".b2", ".b3")):  # biases zero, LayerNorm gains one
                    if held:
                        parameter.fill_(1.0 if "ln_" in name and name.endswith("weight") else 0.0)
                    continue
                std = residual_std if name.endswith(("proj.weight", ".w2")) else 0.02
                shards, kind = heads.get(name, (None, None))
                shape = shards.full_shape(kind, parameter) if shards is not None else parameter.shape
                drawn = torch.randn(shape, generator=generator) * std  # a head's drawn whole: any MP size alike
                if held:
                    parameter.copy_(drawn if shards is None else shards.shard_tensor(kind, drawn, self.groups.rank))
            stds = {"w1": 0.02, "w3": 0.02, "w2": residual_std}
            for ordinal, index in enumerate(self.config.moe_blocks):  # each rank draws its own experts alone
                if (layer := self.blocks[index].moe) is not None:
                    layer.experts.reset_by_expert(layer.placement.local_slices(layer.rank), seed * 1000 + ordinal + 1,
                                                  layer.config.hidden_dim, stds)

    def _parameters_in_drawing_order(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The whole model's parameters in their order: this part's, and stand-ins on the meta
        device (shapes, no storage) for what another part holds."""
        config = self.config
        with torch.device("meta"):
            stand_ins = {"token_embedding": nn.Embedding(config.vocab_size, config.model_dim),
                         "position_embedding": nn.Embedding(config.context, config.model_dim)}
        for name, stand_in in stand_ins.items():
            module = getattr(self, name)
            yield from (module or stand_in).named_parameters(prefix=name)
        for index, block in enumerate(self.blocks):
            if isinstance(block, AbsentBlock):
                with torch.device("meta"):
                    block = Block(config, config.is_moe_block(index), self.groups, self.profile)
            yield from block.named_parameters(prefix=f"blocks.{index}")
        if self.ln_final is not None:
            yield from self.ln_final.named_parameters(prefix="ln_final")

    # -- forward ----------------------------------------------------------------------------------

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx_BT.shape[1]
        if t > self.config.context:
            raise ValueError(f"sequence length {t} exceeds the model's context={self.config.context}")
        positions = torch.arange(t, device=idx_BT.device)
        x = self.token_embedding(idx_BT) + self.position_embedding(positions)
        capacity_factor = None if self.training else self.config.eval_capacity_factor
        for block in self.blocks:
            x = block(x, self.clock, capacity_factor)
        logits_BTV = F.linear(self.ln_final(x), self.token_embedding.weight)  # tied output head
        if targets_BT is None:
            return logits_BTV, None
        lm_loss = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())
        self.last_lm_loss = lm_loss.detach()
        return logits_BTV, lm_loss + total_aux_loss(self.moe_layers(), lm_loss)

    @torch.no_grad()
    def generate(
        self, idx_BT: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``new_tokens`` tokens after the prompt (the context is cropped to the last
        ``context`` tokens)."""
        for _ in range(new_tokens):
            window = idx_BT[:, -self.config.context :]
            logits, _ = self(window)
            logits = logits[:, -1, :] / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probabilities = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probabilities, 1, generator=generator)
            idx_BT = torch.cat([idx_BT, next_token], dim=1)
        return idx_BT


def _is_expert_parameter(name: str) -> bool:
    """An MoE layer's expert weight (``blocks.3.ffn.experts.w1``): drawn by expert, not in model order."""
    return name.split(".")[2:4] == ["ffn", "experts"]


def total_aux_loss(layers: list[MoELayer], like: torch.Tensor) -> torch.Tensor:
    """The sum of the layers' weighted router losses of their last forward (in the graph)."""
    return sum((layer.aux_loss for layer in layers), start=like.new_zeros(()))


def phase_seconds(model: TrainableLM) -> dict[str, float]:
    """The step's time per phase from the model's clock and its MoE layers' pipeline timings:
    routing is the MoE time outside the pipelined region (gate, top-k, encode, decode), all_to_all
    the part of that region not spent in expert compute (communication the pipeline did not hide).
    ``other`` (embeddings, norms, head, loss) is left to the caller, who knows the step time."""
    seconds = model.clock.seconds
    region = expert = 0.0
    for layer in model.moe_layers():
        if layer.last_stats is not None:
            region += layer.last_stats.timing.total_s
            expert += layer.last_stats.timing.expert_total_s
    moe = seconds.get("moe", 0.0)
    return {
        "attention": seconds.get("attention", 0.0),
        "routing": max(0.0, moe - region),
        "all_to_all": max(0.0, region - expert),
        "experts": expert,
        "dense_ffn": seconds.get("dense_ffn", 0.0),
    }


def moe_non_gemm_share(seconds: dict[str, float]) -> float | None:
    """The share of the MoE layers' time outside the expert compute (routing, encode/decode and
    all-to-all not hidden), from phase times as :func:`phase_seconds` names them."""
    moe = seconds["routing"] + seconds["all_to_all"] + seconds["experts"]
    return (moe - seconds["experts"]) / moe if moe else None
