"""The corpus a training run reads: the trainer's own tokenizer's, or a Hugging Face model's."""

from __future__ import annotations

from pathlib import Path

from moeflow.data import PreparedCorpus, prepare_corpus
from moeflow.training.config import TrainConfig


def prepared_corpus(config: TrainConfig, cache_root: Path) -> PreparedCorpus:
    """The corpus ``config`` trains on, from the cache under ``cache_root`` (built if missing), with
    the --hf model's own tokenizer when there is one."""
    if config.hf is not None:
        from moeflow.training.hf_model import prepare_hf_corpus  # Hugging Face stays an optional import

        return prepare_hf_corpus(config, cache_root)
    return prepare_corpus(config.data, config.tokenizer, config.vocab_size, config.val_percent, cache_root=cache_root)
