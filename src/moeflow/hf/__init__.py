"""Hugging Face transformers interop: run a transformers MoE model's sparse blocks on moeflow.

Needs the ``hf`` extra (``pip install moeflow[hf]``). Importing this package registers moeflow as
transformers' expert-parallel backend, ``ep_implementation="moeflow"``
(:mod:`moeflow.hf.expert_parallel`; :func:`configure` sets how it moves tokens); the conversion
itself reads modules duck-typed.
"""

from moeflow.hf.blocks import HFMoEBlock, from_hf_block, moe_blocks, replace_moe_blocks, to_hf
from moeflow.hf.expert_parallel import configure
from moeflow.hf.families import FAMILIES, SUPPORTED

configure()  # ep_implementation="moeflow" with the default settings

__all__ = [
    "FAMILIES", "SUPPORTED", "HFMoEBlock", "configure", "from_hf_block", "moe_blocks", "replace_moe_blocks", "to_hf",
]
