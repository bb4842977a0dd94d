"""The part of a model one pipeline rank holds: some of its blocks, and the ends its stages run.

A rank builds only its part (expert parallelism's rule, kept by the pipeline: no rank holds what
another rank's stages run); an absent block keeps its place in ``blocks``, so that what is held
keeps the whole model's names (``blocks.5.ffn.experts.w1``) in state dicts and checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelPart:
    """Blocks by index; ``embeddings``: the token and position embeddings (the first stage);
    ``head``: the final norm and the output head, tied to the token embedding (the last stage)."""

    blocks: frozenset[int]
    embeddings: bool
    head: bool

    @staticmethod
    def whole(layers: int) -> ModelPart:
        return ModelPart(frozenset(range(layers)), embeddings=True, head=True)

    @staticmethod
    def of_stages(stage_blocks: Iterable[range], first: bool, last: bool) -> ModelPart:
        """The union of some stages' blocks, with the first stage's ends and the last's."""
        return ModelPart(frozenset(index for blocks in stage_blocks for index in blocks), first, last)

    @property
    def token_embedding(self) -> bool:
        """The first stage embeds with it and the last's head is tied to it: both hold a copy."""
        return self.embeddings or self.head


class AbsentBlock(nn.Module):
    """The place of a block another pipeline rank holds: no parameters, and no forward here."""

    moe = None

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError(f"block {self.index} is held by another pipeline stage: this part of the model "
                           "runs through its pipeline's stages (moeflow.pipeline), not on its own")
