"""The optimizer and its learning-rate schedule (nanoGPT's AdamW grouping, warmup then cosine)."""

from __future__ import annotations

import math

import torch

from moeflow.models import TrainableLM
from moeflow.training.config import TrainConfig


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay from the peak to the final learning rate at the last step."""
    if config.warmup_steps and step <= config.warmup_steps:
        return config.peak_lr * step / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    peak, final = config.peak_lr, config.final_lr
    return final + 0.5 * (peak - final) * (1 + math.cos(math.pi * min(1.0, progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, config: TrainConfig, step: int) -> float:
    """Every parameter group at the schedule's rate for ``step``; returns it (the step's record)."""
    lr = learning_rate(config, step)
    for group_settings in optimizer.param_groups:
        group_settings["lr"] = lr
    return lr


def build_optimizer(model: TrainableLM, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (biases, norms) do not (nanoGPT)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.peak_lr, betas=(config.beta1, config.beta2), foreach=False,
    )
