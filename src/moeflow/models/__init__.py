"""Models built on :class:`~moeflow.MoELayer`."""

from moeflow.models.transformer import PHASES, MoETransformer, TransformerConfig

__all__ = ["PHASES", "MoETransformer", "TransformerConfig"]
