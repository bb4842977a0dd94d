"""Training an MoE language model end to end: config, data loop, checkpoints, report, sampling."""

from moeflow.training.config import TrainConfig

__all__ = ["TrainConfig"]
