"""Tiny random-weight transformers MoE models for the interop tests (made here, never downloaded)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

COMMON = {"vocab_size": 96, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}


def tiny_config(family: str, **overrides: Any):
    """A transformers config of ``family`` (mixtral, qwen2_moe, qwen3_moe, qwen3_moe_norm, deepseek_v3)."""
    import transformers

    if family == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **COMMON, intermediate_size=32, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1,
        )
    elif family in ("qwen3_moe", "qwen3_moe_norm"):
        cfg = transformers.Qwen3MoeConfig(
            **COMMON, head_dim=4, intermediate_size=32, moe_intermediate_size=12, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=family == "qwen3_moe_norm", decoder_sparse_step=1,
        )
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, intermediate_size=32, moe_intermediate_size=12,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=None,
            kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
        )
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Weights of unit-ish scale, so routing has no near-ties, and a random DeepSeek selection bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            if "norm" in name and tensor.dim() == 1:
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
            else:
                fan_in = tensor.shape[-1] if tensor.dim() > 1 else 1
                scale = 0.3 if tensor.dim() == 1 else fan_in**-0.5
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)
    return model


def tiny_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, experts: str = "eager", **overrides: Any
):
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=experts)
    return randomize(model, seed).to(dtype).eval()


def saved_tiny_models(folder: Any, families: tuple[str, ...], seed: int) -> dict[str, Any]:
    """Each family's tiny model saved in a folder of its own (``folder``: pytest's tmp_path_factory)."""
    paths = {}
    for family in families:
        paths[family] = folder.mktemp(family)
        tiny_model(family, seed=seed).save_pretrained(paths[family])
    return paths


class _V4Expert(nn.Module):
    """One SwiGLU expert as transformers v4 stored it (w1/w3/w2 for Mixtral, gate/up/down otherwise)."""

    def __init__(self, names: tuple[str, str, str], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.names = names
        for name, weight in zip(names, (gate, up, down), strict=True):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
            linear.weight.data.copy_(weight)
            setattr(self, name, linear)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class _V4Block(nn.Module):
    """A v5 sparse MoE block rebuilt in transformers v4's layout and forward: per-expert modules,
    an ``nn.Linear`` gate (Mixtral, Qwen-MoE), ``(hidden, router_logits)`` returned (not DeepSeek)."""

    def __init__(self, v5: nn.Module) -> None:
        super().__init__()
        self.deepseek = type(v5).__name__ == "DeepseekV3MoE"
        self.top_k = v5.gate.top_k
        self.norm_topk_prob = getattr(v5.gate, "norm_topk_prob", True)
        if self.deepseek:
            self.gate = v5.gate
        else:
            self.gate = nn.Linear(v5.gate.weight.shape[1], v5.gate.weight.shape[0], bias=False)
            self.gate.weight = nn.Parameter(v5.gate.weight.detach().clone())
        names = ("w1", "w3", "w2") if type(v5).__name__.startswith("Mixtral") else ("gate_proj", "up_proj", "down_proj")
        gate_up, down = v5.experts.gate_up_proj.detach(), v5.experts.down_proj.detach()
        half = gate_up.shape[1] // 2
        self.experts = nn.ModuleList(
            _V4Expert(names, gate_up[e, :half], gate_up[e, half:], down[e]) for e in range(gate_up.shape[0])
        )
        for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
            if hasattr(v5, name):
                setattr(self, name, getattr(v5, name))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.deepseek:
            logits, weights, idx = self.gate(x)
            return logits, weights, idx
        logits = self.gate(x)
        weights, idx = torch.topk(torch.softmax(logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype), idx

    def forward(self, hidden_states: torch.Tensor):
        batch, seq, dim = hidden_states.shape
        x = hidden_states.reshape(-1, dim)
        logits, weights, idx = self._route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None].to(x.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        out = out.reshape(batch, seq, dim)
        return out if self.deepseek else (out, logits)


def as_v4_block(v5_block: nn.Module) -> nn.Module:
    """``v5_block`` in v4's layout, under the same class name (which is how blocks are recognised)."""
    cls = type(type(v5_block).__name__, (_V4Block,), {})
    return cls(v5_block)


def word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over the words w0..w{V-1} (w0 pads, w1 is unknown)."""
    import tokenizers
    import transformers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    model.decoder = tokenizers.decoders.WordPiece(prefix="##")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="w1", pad_token="w0")


def greedy_reference(model, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (no padding), new tokens up to EOS."""
    outputs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs
