"""Tiny random models of every transformers MoE family with an expert-parallel plan, made from
transformers' own config classes (no download): one set of small sizes, applied to the fields a
family has, and the few a family needs beside them."""

from __future__ import annotations

from typing import Any

SMALL: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
    "expert_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 64, "pad_token_id": 0, "tie_word_embeddings": False,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "num_experts_per_topk": 2,
    "num_shared_experts": 1, "n_shared_experts": 1, "first_k_dense_replace": 0, "decoder_sparse_step": 1,
    "moe_layer_freq": 1, "mlp_only_layers": [], "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
}
"""The small sizes, for whichever of these fields a family's config has."""
MLA = {"num_key_value_heads": 4, "v_head_dim": 4, "head_dim": 4}
"""Multi-head latent attention's heads: as many key/value heads as query heads, small value heads."""
FAMILY_SIZES: dict[str, dict[str, Any]] = {
    **{name: MLA for name in ("deepseek_v3", "deepseek_v32", "axk1", "axk2", "glm4_moe_lite", "glm_moe_dsa",
                              "mistral_large4_text")},
    "zaya": {"num_experts_per_tok": 1},
}
"""What a family needs beside :data:`SMALL`."""


def ep_families() -> list[str]:
    """The model types whose config carries an expert-parallel plan (transformers' registry)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(name for name, config in CONFIG_MAPPING_NAMES.items()
                  if getattr(getattr(transformers, config, None), "base_model_ep_plan", None))


def tiny_family_config(model_type: str, **overrides: Any) -> Any:
    """A small config of ``model_type``: :data:`SMALL`'s fields it has, then its own needs, then
    whichever of ``overrides`` it has."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    defaults = config_class()
    sizes = {key: value for key, value in SMALL.items() if hasattr(defaults, key)}
    changes = {key: value for key, value in overrides.items() if hasattr(defaults, key)}
    return config_class(**{**sizes, **FAMILY_SIZES.get(model_type, {}), **changes})


def tiny_family_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """The causal LM of ``model_type`` at :func:`tiny_family_config`'s sizes (its base model where
    it has no causal LM head class), fp32, random weights from ``seed``."""
    import torch
    import transformers

    config = tiny_family_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError:
        return transformers.AutoModel.from_config(config, dtype=torch.float32)


def family_batch(rank: int) -> Any:
    """Rank ``rank``'s batch of token ids for a tiny family model: 2 sequences of 8 (its vocabulary
    of :data:`SMALL`)."""
    import torch

    return torch.randint(0, SMALL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(100 + rank))
