"""The sparse MoE blocks of Hugging Face transformers that moeflow replaces, and how each routes.

Read from transformers' source (v5.23 fused experts; v4 per-expert modules where they differ):

- **Mixtral** (``MixtralSparseMoeBlock``): logits ``x W^T`` in the input's dtype, softmax in fp32,
  top-k, the k weights always renormalised to sum to one. Experts w1 (gate), w3 (up), w2 (down),
  SwiGLU with silu. v4 returned ``(hidden, router_logits)``; v5 returns the hidden states.
  Input jitter (``router_jitter_noise``) is a training-only perturbation moeflow does not copy.
- **Qwen2-MoE** (``Qwen2MoeSparseMoeBlock``): as Mixtral, but the weights are renormalised only with
  ``norm_topk_prob``; a shared expert (its own ``shared_expert_intermediate_size``) whose output
  is scaled by ``sigmoid(x . w_gate)`` (``shared_expert_gate``, one bias-free row) is added.
- **Qwen3-MoE** (``Qwen3MoeSparseMoeBlock``): Qwen2-MoE without the shared expert.
- **DeepSeek-V3** (``DeepseekV3MoE``): logits in fp32, sigmoid scores. The selection adds
  ``e_score_correction_bias`` (selection only); experts are in ``n_group`` equal groups, a group
  scores the sum of its two best biased scores, and a token picks only in its ``topk_group`` best
  groups. The combine weights are the unbiased sigmoid scores, renormalised with
  ``norm_topk_prob`` (transformers adds 1e-20 to the denominator; moeflow adds nothing, which is
  the same in fp32 unless k sigmoids sum below 1e-13), then times ``routed_scaling_factor``.
  ``n_shared_experts`` shared experts run as one MLP of ``n_shared_experts * moe_intermediate_size``.

Everywhere the combine weights are fp32; transformers v5 casts Qwen's to the input's dtype (no
change in fp32/fp64) and multiplies in fp32 before the cast back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Family:
    """One architecture: how to read its routing settings from a block."""

    name: str
    model_type: str
    block_class: str
    score_function: str
    gate_precision: str
    shared: str | None  # attribute of the shared expert MLP, if any
    shared_gate: str | None  # attribute of Qwen2's sigmoid shared-expert gate, if any


FAMILIES = (
    Family("Mixtral", "mixtral", "MixtralSparseMoeBlock", "softmax", "input", None, None),
    Family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeSparseMoeBlock", "softmax", "input", "shared_expert",
           "shared_expert_gate"),
    Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "softmax", "input", None, None),
    Family("DeepSeek-V3", "deepseek_v3", "DeepseekV3MoE", "sigmoid", "fp32", "shared_experts", None),
)
"""The transformers MoE families moeflow converts: each one's sparse block class and routing conventions."""
SUPPORTED = ", ".join(f"{f.name} ({f.block_class})" for f in FAMILIES)
"""The supported families and their block classes, as error messages name them."""


def family_of(block: nn.Module) -> Family | None:
    name = type(block).__name__
    return next((f for f in FAMILIES if f.block_class == name), None)


def family_for_model_type(model_type: str) -> Family:
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    raise ValueError(
        f"moeflow.hf cannot convert model_type={model_type!r}; supported architectures: {SUPPORTED}"
    )


def _first(*candidates: Any) -> Any:
    return next((c for c in candidates if c is not None), None)


def routing_settings(block: nn.Module, family: Family) -> dict[str, Any]:
    """The MoELayer routing arguments of ``block`` (v4 kept them on the block, v5 on its router)."""
    gate = block.gate
    top_k = _first(getattr(gate, "top_k", None), getattr(block, "top_k", None))
    if top_k is None:
        raise ValueError(f"cannot find top_k on the {type(block).__name__} block or its gate")
    settings: dict[str, Any] = {
        "top_k": int(top_k), "score_function": family.score_function, "gate_precision": family.gate_precision,
    }
    if family.name == "Mixtral":
        jitter = _first(getattr(block, "jitter_noise", None), 0.0)
        if jitter:
            raise ValueError(
                f"the Mixtral block has router_jitter_noise={jitter}; moeflow does not copy input jitter: "
                "set config.router_jitter_noise=0 before converting"
            )
        settings["normalize_gate"] = True
        return settings
    norm = _first(getattr(gate, "norm_topk_prob", None), getattr(block, "norm_topk_prob", None))
    settings["normalize_gate"] = bool(norm)
    if family.name == "DeepSeek-V3":
        settings["expert_groups"] = int(_first(getattr(gate, "n_group", None), getattr(gate, "num_group", None), 1))
        settings["top_groups"] = int(_first(getattr(gate, "topk_group", None), 1))
        settings["routed_scaling_factor"] = float(_first(getattr(gate, "routed_scaling_factor", None), 1.0))
    return settings
