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

Most other families are transformers' own copies of one of these four under another name, or differ
in where a setting lives (the router at ``block.router``, the selection bias on the block, the scaling
factor's name) or fix what these read (always renormalised, never): :data:`FAMILIES` says where each
reads. Softmax over the k chosen logits (Granite's, gpt-oss's) is softmax then renormalisation.
gpt-oss adds a learned bias to the router's logits (``router_bias``) and its experts are clamped
SwiGLU (``clamp``) with biases, in a transposed, interleaved layout (:mod:`moeflow.hf.weights`).

Everywhere the combine weights are fp32; transformers v5 casts Qwen's to the input's dtype (no
change in fp32/fp64) and multiplies in fp32 before the cast back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertsClamp:
    """Where a family's experts keep clamped SwiGLU's cap and alpha (attributes of ``block.experts``;
    alpha None: 1, silu) and the up half's fixed offset (:class:`moeflow.core.clamped_swiglu.ClampedSwiGLU`)."""

    limit: str
    alpha: str | None = None
    up_offset: float = 0.0
    shared: bool = False  # the shared MLP clamped as well (MiniMax-M3's)


@dataclass(frozen=True)
class Family:
    """One architecture: its block, and where a block of it keeps each routing setting (paths
    from the block, dotted)."""

    name: str
    model_type: str
    block_class: str
    score_function: str
    gate_precision: str
    shared: str | None  # the shared expert MLP, if any
    shared_gate: str | None  # Qwen2's sigmoid shared-expert gate, if any
    normalize: bool | None = None  # None: the router's ``norm_topk_prob``
    grouped: bool = False  # DeepSeek-V3's group-limited selection (``n_group``, ``topk_group`` on the router)
    router: str = "gate.weight"  # the router's (E, M) weight
    bias: str | None = None  # the selection-only bias (E,), if any
    scale: str | None = None  # the routed scaling factor, if any
    requires: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (path, the values it may hold to route as above)
    clamp: ExpertsClamp | None = None  # clamped SwiGLU experts (HY-V4's), else SwiGLU with silu
    router_bias: str | None = None  # a learned bias on the router's logits (gpt-oss's), if any
    returns_scores: bool = False  # the block returns (hidden, router output), its decoder layer drops the second


def _mixtral(name: str, model_type: str, block_class: str, **where: Any) -> Family:
    """Mixtral's block: softmax of input-dtype logits, the k weights always renormalised."""
    return Family(name, model_type, block_class, "softmax", "input", None, None, normalize=True, **where)


def _qwen2(name: str, model_type: str, block_class: str, **where: Any) -> Family:
    """Qwen2-MoE's block: Qwen3's routing and a shared expert behind a sigmoid gate."""
    return Family(name, model_type, block_class, "softmax", "input", "shared_expert", "shared_expert_gate", **where)


def _qwen3(name: str, model_type: str, block_class: str, **where: Any) -> Family:
    """Qwen3-MoE's block: softmax of input-dtype logits, renormalised with ``norm_topk_prob``."""
    return Family(name, model_type, block_class, "softmax", "input", None, None, **where)


DEEPSEEK_V3 = Family("DeepSeek-V3", "deepseek_v3", "DeepseekV3MoE", "sigmoid", "fp32", "shared_experts", None,
                     grouped=True, bias="gate.e_score_correction_bias", scale="gate.routed_scaling_factor")
"""DeepSeek-V3's block: fp32 sigmoid scores, correction bias, groups, scaling, shared experts."""


def _deepseek_v3(name: str, model_type: str, block_class: str, **changes: Any) -> Family:
    return replace(DEEPSEEK_V3, name=name, model_type=model_type, block_class=block_class, **changes)


FAMILIES = (
    _mixtral("Mixtral", "mixtral", "MixtralSparseMoeBlock"),
    _mixtral("MiniMax", "minimax", "MiniMaxSparseMoeBlock"),
    _mixtral("GraniteMoE", "granitemoe", "GraniteMoeMoE", router="router.weight"),
    _mixtral("GraniteMoE-SWA", "granitemoe_swa", "GraniteMoeSWAMoE", router="router.weight"),
    _mixtral("GraniteMoE-Shared", "granitemoeshared", "GraniteMoeSharedMoE", router="router.weight"),
    _qwen2("Qwen2-MoE", "qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    _qwen2("Qwen3-Next", "qwen3_next", "Qwen3NextSparseMoeBlock"),
    _qwen2("Qwen3.5-MoE", "qwen3_5_moe_text", "Qwen3_5MoeSparseMoeBlock", normalize=True),
    _qwen2("Qwen4-Exp", "qwen4_exp_text", "Qwen4ExpTextSparseMoeBlock"),
    _qwen3("Qwen3-MoE", "qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    _qwen3("Qwen3-VL-MoE", "qwen3_vl_moe_text", "Qwen3VLMoeTextSparseMoeBlock", normalize=True),
    _qwen3("Mellum", "mellum", "MellumSparseMoeBlock"),
    _qwen3("OLMoE", "olmoe", "OlmoeSparseMoeBlock"),
    _qwen3("FlexOlmo", "flex_olmo", "FlexOlmoSparseMoeBlock"),
    _qwen3("Jamba", "jamba", "JambaSparseMoeBlock", normalize=False, router="router.weight"),
    Family("HunYuan-MoE-V1", "hunyuan_v1_moe", "HunYuanMoEV1Moe", "softmax", "input", "shared_mlp", None,
           normalize=True, router="gate.wg.weight"),
    Family("ERNIE-4.5-MoE", "ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", "softmax", "fp32", "shared_experts", None,
           normalize=True, bias="gate.moe_statics.e_score_correction_bias"),
    Family("Flint", "flint", "FlintSparseMoeBlock", "sigmoid", "fp32", "shared_expert", None),
    DEEPSEEK_V3,
    _deepseek_v3("DeepSeek-V3.2", "deepseek_v32", "DeepseekV32MoE"),
    _deepseek_v3("Sarvam-MLA", "sarvam_mla", "DeepseekV3MoE"),
    _deepseek_v3("dots.llm1", "dots1", "Dots1MoE"),
    _deepseek_v3("EXAONE-MoE", "exaone_moe", "ExaoneMoeSparseMoEBlock"),
    _deepseek_v3("GLM-4-MoE", "glm4_moe", "Glm4MoeMoE"),
    _deepseek_v3("GLM-4-MoE-Lite", "glm4_moe_lite", "Glm4MoeLiteMoE"),
    _deepseek_v3("GLM-MoE-DSA", "glm_moe_dsa", "GlmMoeDsaMoE"),
    _deepseek_v3("Solar-Open", "solar_open", "SolarOpenMoE"),
    _deepseek_v3("Bailing-Hybrid", "bailing_hybrid", "BailingHybridMoE"),
    _deepseek_v3("A.X-K2", "axk2", "AXK2MoE", grouped=False, requires=(("gate.num_group", (None, 1)),)),
    _deepseek_v3("Kimi-Linear", "kimi_linear", "KimiLinearMoE"),
    _deepseek_v3("MiMo-V2-Flash", "mimo_v2_flash", "MiMoV2FlashMoE", shared=None),
    _deepseek_v3("DeepSeek-V2", "deepseek_v2", "DeepseekV2Moe", score_function="softmax", normalize=False,
                 grouped=False, bias=None, requires=(("gate.topk_method", ("greedy",)),)),
    _deepseek_v3("Mistral-4", "mistral4", "Mistral4MoE", score_function="softmax", gate_precision="input",
                 bias=None),
    _deepseek_v3("Mistral-Large-4", "mistral_large4_text", "MistralLarge4TextMoE", score_function="softmax",
                 normalize=True, bias=None),
    _deepseek_v3("HY-V4", "hy_v4", "HYV4MoE", clamp=ExpertsClamp("swiglu_limit")),
    Family("Aria", "aria_text", "AriaTextMoELayer", "softmax", "input", "shared_experts", None, normalize=True,
           router="router.weight"),
    _mixtral("gpt-oss", "gpt_oss", "GptOssMLP", router="router.weight", router_bias="router.bias",
             clamp=ExpertsClamp("limit", "alpha", up_offset=1.0), returns_scores=True),
    Family("OpenAI-Privacy-Filter", "openai_privacy_filter", "OpenAIPrivacyFilterMLP", "softmax", "fp32", None, None,
           normalize=True, router="router.weight", router_bias="router.bias",
           clamp=ExpertsClamp("limit", "alpha", up_offset=1.0), returns_scores=True),
    _deepseek_v3("HY-V3", "hy_v3", "HYV3MoE", normalize=True, grouped=False, bias="e_score_correction_bias",
                 scale="gate.router_scaling_factor"),
    _deepseek_v3("MiniMax-M3", "minimax_m3_vl_text", "MiniMaxM3VLSparseMoeBlock", gate_precision="input",
                 normalize=True, grouped=False, scale="routed_scaling_factor",
                 clamp=ExpertsClamp("swiglu_limit", "swiglu_alpha", up_offset=1.0, shared=True)),
    _deepseek_v3("MiniMax-M2", "minimax_m2", "MiniMaxM2SparseMoeBlock", gate_precision="input", normalize=True,
                 grouped=False, bias="e_score_correction_bias", scale=None, shared=None),
    _deepseek_v3("AFMoE", "afmoe", "AfmoeSparseMoeBlock", gate_precision="input", normalize=True, grouped=False,
                 router="router.gate.weight", bias="expert_bias", scale="router.route_scale"),
    _deepseek_v3("Laguna", "laguna", "LagunaSparseMoeBlock", gate_precision="input", normalize=True, grouped=False,
                 scale="routed_scaling_factor", requires=(("gate.router_logit_softcapping", (0.0,)),)),
)
"""The transformers MoE families moeflow converts: each one's sparse block class and where its routing
settings live (most are transformers' own copies of Mixtral's, Qwen's or DeepSeek-V3's block)."""
SUPPORTED = ", ".join(f.name for f in FAMILIES) + " (docs/guides/huggingface.md: which path each family takes)"
"""The supported families, as error messages name them."""
V4_TUPLE_BLOCKS = ("mixtral", "qwen2_moe", "qwen3_moe")
"""The model types whose transformers v4 block returned ``(hidden, router_logits)``."""


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


def _at(block: nn.Module, path: str) -> Any:
    value: Any = block
    for name in path.split("."):
        value = getattr(value, name, None)
    return value


def router_weight(block: nn.Module, family: Family) -> torch.Tensor:
    """The block's (E, M) router weight."""
    return _at(block, family.router)


def router_bias(block: nn.Module, family: Family) -> torch.Tensor | None:
    """The block's (E,) bias on the router's logits, if its family has one."""
    return None if family.router_bias is None else _at(block, family.router_bias)


def selection_bias(block: nn.Module, family: Family) -> torch.Tensor | None:
    """The block's selection-only bias (any shape of E elements), if its family has one."""
    return None if family.bias is None else _at(block, family.bias)


def shared_mlp(block: nn.Module, family: Family) -> nn.Module | None:
    """The block's shared expert MLP, if its family has one and this block holds it (ERNIE's is
    None with ``moe_num_shared_experts=0``)."""
    return None if family.shared is None else getattr(block, family.shared, None)


def router_module(block: nn.Module, family: Family) -> Any:
    """The module that holds the block's router weight: its output holds the router's logits."""
    return _router_modules(block, family)[0]


def _router_modules(block: nn.Module, family: Family) -> list[Any]:
    """The router module, its parents up to the block: where settings are looked up, nearest first."""
    path = family.router.split(".")[:-1]
    return [_at(block, ".".join(path[:n])) if n else block for n in range(len(path), -1, -1)]


def _setting(block: nn.Module, family: Family, *names: str) -> Any:
    return _first(*(getattr(module, name, None) for module in _router_modules(block, family) for name in names))


def routing_settings(block: nn.Module, family: Family) -> dict[str, Any]:
    """The MoELayer routing arguments of ``block`` (v4 kept them on the block, v5 on its router)."""
    top_k = _setting(block, family, "top_k")
    if top_k is None:
        raise ValueError(f"cannot find top_k on the {type(block).__name__} block or its router")
    jitter = _first(_setting(block, family, "jitter_noise", "router_jitter_noise"), 0.0)
    if jitter:
        raise ValueError(
            f"the {family.name} block has router_jitter_noise={jitter}; moeflow does not copy input jitter: "
            "set config.router_jitter_noise=0 before converting"
        )
    for path, allowed in family.requires:
        if _at(block, path) not in allowed:
            raise ValueError(
                f"the {family.name} block has {path}={_at(block, path)!r}; moeflow converts it only with "
                f"{' or '.join(map(repr, allowed))}: run this model through ep_implementation='moeflow' instead"
            )
    norm = family.normalize
    if norm is None:
        norm = bool(_setting(block, family, "norm_topk_prob"))
    fp32_router = router_weight(block, family).dtype == torch.float32  # its logits then fp32 in every family
    settings: dict[str, Any] = {
        "top_k": int(top_k), "score_function": family.score_function,
        "gate_precision": "fp32" if fp32_router else family.gate_precision, "normalize_gate": norm,
        "gate_bias": family.router_bias is not None,
    }
    if family.grouped:
        settings["expert_groups"] = int(_first(_setting(block, family, "n_group", "num_group"), 1))
        settings["top_groups"] = int(_first(_setting(block, family, "topk_group"), 1))
    if family.scale is not None:
        settings["routed_scaling_factor"] = float(_first(_at(block, family.scale), 1.0))
    return settings


def expert_settings(block: nn.Module, family: Family) -> dict[str, Any]:
    """The MoELayer arguments of the block's experts beyond SwiGLU: clamped SwiGLU's numbers, if any."""
    clamp = family.clamp
    if clamp is None:
        return {}
    experts = block.experts
    alpha = 1.0 if clamp.alpha is None else float(getattr(experts, clamp.alpha))
    return {"swiglu_limit": float(getattr(experts, clamp.limit)), "swiglu_alpha": alpha,
            "swiglu_up_offset": clamp.up_offset, "swiglu_clamp_shared": clamp.shared}
