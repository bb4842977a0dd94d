"""One pipeline stage of a :class:`~moeflow.models.transformer.MoETransformer`.

The first stage embeds the token ids, every stage runs its blocks, and the last applies the final
norm and the tied output head, returning logits (the schedule's loss function takes them). A stage
keeps the model's parameter names (``blocks.3.ffn...``), so a stage's state dict is the slice of
the model's that it holds. Each stage attaches its MoE layers' aux losses to the activation it
sends on (:mod:`moeflow.pipeline.aux_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moeflow.models.transformer import MoETransformer, total_aux_loss
from moeflow.moe.layer import MoELayer
from moeflow.pipeline.aux_loss import attach_aux_loss
from moeflow.pipeline.split import StageSplit


class TransformerStage(nn.Module):
    """Stage ``index`` of ``split`` over ``model``'s modules (shared with it, not copied). The
    first and the last stage both hold the token embedding (the head is tied to it): on different
    ranks, their gradients are summed after the backward (:mod:`moeflow.pipeline.tied`)."""

    def __init__(self, model: MoETransformer, index: int, split: StageSplit, checkpointed: bool = False,
                 microbatches: int = 1) -> None:
        """``checkpointed``: each block's activations recomputed in the backward (activation
        checkpointing), each recompute naming its forward to the MoE layers (``microbatches``:
        the calls a step makes, whose records they keep)."""
        super().__init__()
        self.checkpointed, self.microbatches, self.calls = checkpointed, microbatches, 0
        self.index, self.num_stages = index, split.num_stages
        self.is_first, self.is_last = index == 0, index == split.num_stages - 1
        self.config, self.clock = model.config, model.clock
        self.blocks = nn.ModuleDict({str(block): model.blocks[block] for block in split.blocks[index]})
        self.token_embedding = model.token_embedding if self.is_first or self.is_last else None
        self.position_embedding = model.position_embedding if self.is_first else None
        self.ln_final = model.ln_final if self.is_last else None
        self.aux_losses: list[torch.Tensor] = []  # this step's, one per micro-batch (detached): the logged loss

    def moe_layers(self) -> list[MoELayer]:
        return [block.moe for block in self.blocks.values() if block.moe is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, M) on the others; logits
        (B, T, V) out of the last, hidden states out of the others."""
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        capacity_factor = None if self.training else self.config.eval_capacity_factor
        for block in self.blocks.values():
            if self.checkpointed and torch.is_grad_enabled():
                self.calls += 1
                x = checkpoint(self._named_call, block, self.calls, x, capacity_factor, use_reentrant=False)
            else:
                x = block(x, self.clock, capacity_factor)
        aux_loss = total_aux_loss(self.moe_layers(), x)
        self.aux_losses.append(aux_loss.detach())
        x = attach_aux_loss(x, aux_loss)
        if self.is_last:
            return F.linear(self.ln_final(x), self.token_embedding.weight)
        return x

    def _named_call(self, block: nn.Module, name: int, x: torch.Tensor, capacity_factor: float | None) -> torch.Tensor:
        """A block's forward named ``name`` (its recompute passes the same name), so that its MoE
        layer's recompute repeats this forward's plan whatever order the backwards run in."""
        layer = block.moe
        if layer is None:
            return block(x, self.clock, capacity_factor)
        with layer.forward_memory.call(name, self.microbatches):
            return block(x, self.clock, capacity_factor)

    def take_aux_losses(self) -> torch.Tensor:
        """The sum of this stage's aux losses over the step's micro-batches, divided by their
        number (what its share of the step's loss is), and a clean slate for the next step."""
        losses, self.aux_losses = self.aux_losses, []
        return torch.stack(losses).mean() if losses else torch.zeros(())
