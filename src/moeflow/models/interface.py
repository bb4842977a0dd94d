"""What the trainer and its checkpoints use of a language model, so that moeflow's own
:class:`~moeflow.models.MoETransformer` and a converted transformers model (``moeflow.hf``) train
through one loop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from moeflow.comm.groups import ParallelGroups
from moeflow.moe.layer import MoELayer
from moeflow.parallel.placement import PlacedParameter
from moeflow.timing.phases import PhaseClock


class TrainableLM(Protocol):
    """``model(idx, targets)`` returns (logits, loss): mean cross-entropy plus the MoE layers'
    router losses; ``last_lm_loss`` keeps the cross-entropy alone."""

    clock: PhaseClock
    last_lm_loss: torch.Tensor | None
    groups: ParallelGroups
    training: bool

    def __call__(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None) -> tuple[Any, Any]: ...

    def moe_layers(self) -> list[MoELayer]: ...

    def moe_block_indices(self) -> list[int]: ...

    def placed_parameters(self) -> dict[str, PlacedParameter]: ...

    def expert_parameter_names(self) -> set[str]: ...

    def tensor_parallel_parameter_names(self) -> set[str]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...
