"""Hugging Face transformers interop: run a transformers MoE model's sparse blocks on moeflow.

Needs the ``hf`` extra (``pip install moeflow[hf]``) only for loading models; the conversion
itself reads modules duck-typed, so importing this package does not import transformers.
"""

from moeflow.hf.blocks import HFMoEBlock, from_hf_block, moe_blocks, replace_moe_blocks, to_hf
from moeflow.hf.families import FAMILIES, SUPPORTED

__all__ = ["FAMILIES", "SUPPORTED", "HFMoEBlock", "from_hf_block", "moe_blocks", "replace_moe_blocks", "to_hf"]
