"""Models built on :class:`~moeflow.MoELayer`."""

from moeflow.models.interface import TrainableLM
from moeflow.models.transformer import MoETransformer, TransformerConfig

__all__ = ["MoETransformer", "TrainableLM", "TransformerConfig"]
