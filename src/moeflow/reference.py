"""The plain single-process reference MoE: the oracle of the tests and the baseline of benchmarks.

Written for reading, in the manner of Hugging Face's Mixtral block: route, fill capacity slots in a
plain loop, then a loop over experts, each gathering its own tokens. It defines the semantics every
optimized path must reproduce (same parameter names as :class:`moeflow.MoELayer` with all E experts
local, so a single-process layer's state dict loads here unchanged).

A forward handles the tokens of one rank: capacity uses this call's token count T. With
``routing_groups`` = n (Parm's S1, whose n MP members each route their own partition), the tokens
are cut into n contiguous groups of ceil(T / n) (the last shorter), each filled on its own with the
capacity of the largest group; the choices and the balance loss stay those of all T tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import resolve_normalize_gate


class _Params(nn.Module):
    """A plain container, so state-dict names read ``gate.weight``, ``experts.w1`` and so on."""


def _expert_params(num: int, model_dim: int, hidden_dim: int, swiglu: bool, bias: bool) -> _Params:
    params = _Params()
    params.w1 = nn.Parameter(torch.randn(num, model_dim, hidden_dim) * model_dim**-0.5)
    params.w2 = nn.Parameter(torch.randn(num, hidden_dim, model_dim) * hidden_dim**-0.5)
    if bias:
        params.b1 = nn.Parameter(torch.zeros(num, hidden_dim))
        params.b2 = nn.Parameter(torch.zeros(num, model_dim))
    if swiglu:
        params.w3 = nn.Parameter(torch.randn(num, model_dim, hidden_dim) * model_dim**-0.5)
        if bias:
            params.b3 = nn.Parameter(torch.zeros(num, hidden_dim))
    return params


class ReferenceMoE(nn.Module):
    """Same arguments and semantics as :class:`moeflow.MoELayer`, single process, no tricks."""

    def __init__(
        self,
        model_dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.0,
        gate: str = "softmax",
        activation: str = "gelu",
        normalize_gate: bool | None = None,
        batch_prioritized_routing: bool = False,
        aux_loss_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        *,
        bias: bool = True,
        gate_precision: str = "fp32",
        gate_bias: bool = False,
        score_function: str = "softmax",
        num_shared_experts: int = 0,
        shared_hidden_dim: int | None = None,
        shared_expert_gate: bool = False,
        expert_bias_update_rate: float = 0.0,
        expert_groups: int = 1,
        top_groups: int = 1,
        routed_scaling_factor: float = 1.0,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.0,
        swiglu_up_offset: float = 0.0,
        swiglu_clamp_shared: bool = False,
        cosine_projection_dim: int = 256,
        cosine_min_temperature: float = 0.01,
        node_experts: Sequence[int] | None = None,
        remote_share: float = 1.0,
    ) -> None:
        super().__init__()
        self.model_dim, self.num_experts, self.top_k = model_dim, num_experts, top_k
        self.capacity_factor, self.gate_kind, self.activation = capacity_factor, gate, activation
        self.normalize_gate, self.batch_prioritized_routing = normalize_gate, batch_prioritized_routing
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.score_function, self.expert_bias_update_rate = score_function, expert_bias_update_rate
        self.max_logit_scale = math.log(1.0 / cosine_min_temperature)
        self.expert_groups, self.top_groups = expert_groups, top_groups
        self.routed_scaling_factor = routed_scaling_factor
        self.swiglu_clamp = (swiglu_limit, swiglu_alpha, swiglu_up_offset)
        self.swiglu_clamp_shared = swiglu_clamp_shared  # else the routed experts only
        self.gate_precision = gate_precision
        # FasterMoE's topology-aware gate: the experts on this rank's node, and the share of its
        # tokens that may pick experts elsewhere (None: no limit)
        self.node_experts, self.remote_share = node_experts, remote_share

        self.gate = _Params()
        if gate == "cosine":
            self.gate.projection = nn.Parameter(torch.randn(cosine_projection_dim, model_dim))
            self.gate.weight = nn.Parameter(torch.randn(num_experts, cosine_projection_dim))
            self.gate.logit_scale = nn.Parameter(torch.full((1,), math.log(2.0)))
        else:
            self.gate.weight = nn.Parameter(torch.randn(num_experts, model_dim) * model_dim**-0.5)
            if gate_bias:
                self.gate.bias = nn.Parameter(torch.randn(num_experts) * 0.5)
        self.gate.register_buffer("expert_bias", torch.zeros(num_experts))
        swiglu = activation == "swiglu"
        self.experts = _expert_params(num_experts, model_dim, hidden_dim, swiglu, bias)
        shared_hidden = hidden_dim if shared_hidden_dim is None else shared_hidden_dim
        self.shared_experts = (
            _expert_params(num_shared_experts, model_dim, shared_hidden, swiglu, bias) if num_shared_experts else None
        )
        self.shared_expert_gate = nn.Linear(model_dim, 1, bias=False) if shared_expert_gate else None
        self.global_load: Callable[[torch.Tensor], torch.Tensor] | None = None
        """In a multi-rank run the bias follows the load summed over ranks: set this to that sum."""
        self.routing_groups = 1
        """Groups of tokens whose slots and capacity are filled apart (Parm's S1 partitions)."""
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert: list[int] = []
        self.dropped_per_expert: list[int] = []
        self.capacity = 0

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.gate, "bias", None)  # gpt-oss's router bias
        if self.gate_precision == "input":  # Mixtral, Qwen-MoE: logits in x's dtype, then fp32
            return (x @ self.gate.weight.t() + (0.0 if bias is None else bias)).float()
        x = x.float()
        if self.gate_kind == "cosine":
            projected = F.normalize(x @ self.gate.projection.float().t(), dim=-1)
            experts = F.normalize(self.gate.weight.float(), dim=-1)
            scale = torch.exp(self.gate.logit_scale.float().clamp(max=self.max_logit_scale))
            return projected @ experts.t() * scale
        return x @ self.gate.weight.float().t() + (0.0 if bias is None else bias.float())

    def limit_to_node(self, chooser: torch.Tensor) -> torch.Tensor:
        """The topology-aware gate: if more than floor(share * T) tokens have their best expert off
        this node, those with the highest best scores (that many) keep their choice; all other
        tokens choose among the node's experts only."""
        T = chooser.shape[0]
        local = [e in set(self.node_experts) for e in range(self.num_experts)]
        best = chooser.argmax(-1).tolist()
        remote = [t for t in range(T) if not local[best[t]]]
        allowed = int(self.remote_share * T)
        if len(remote) <= allowed:
            return chooser
        remote.sort(key=lambda t: -float(chooser[t, best[t]]))
        going = set(remote[:allowed])
        limited = chooser.clone()
        for t in range(T):
            if t not in going:
                limited[t, [e for e in range(self.num_experts) if not local[e]]] = float("-inf")
        return limited

    def ffn(self, params: _Params, e: int, x: torch.Tensor) -> torch.Tensor:
        has_bias = hasattr(params, "b1")
        h = x @ params.w1[e] + (params.b1[e] if has_bias else 0.0)
        if self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "gelu":
            h = F.gelu(h)
        elif self.activation == "silu":
            h = F.silu(h)
        elif self.activation == "swiglu":
            clamped = params is self.experts or self.swiglu_clamp_shared
            h = self.swiglu(h, x @ params.w3[e] + (params.b3[e] if has_bias else 0.0), clamped=clamped)
        else:
            raise ValueError(f"unknown activation {self.activation!r}")
        return h @ params.w2[e] + (params.b2[e] if has_bias else 0.0)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, clamped: bool) -> torch.Tensor:
        """silu(gate) * up; gpt-oss's clamped form when ``swiglu_limit`` is set (``clamped``: experts it applies to)."""
        limit, alpha, up_offset = self.swiglu_clamp
        if limit is None or not clamped:
            return F.silu(gate) * up
        gate = gate.clamp(max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + up_offset)

    def forward(
        self, x: torch.Tensor, top_k: int | None = None, capacity_factor: float | None = None
    ) -> torch.Tensor:
        k = self.top_k if top_k is None else top_k
        f = self.capacity_factor if capacity_factor is None else capacity_factor
        E = self.num_experts
        tokens = x.reshape(-1, self.model_dim)
        T = tokens.shape[0]

        # 1. route: scores, the k best experts (bias only shifts the choice), combine weights
        logits = self.gate_logits(tokens)
        scores = torch.softmax(logits, -1) if self.score_function == "softmax" else torch.sigmoid(logits)
        chooser = scores.detach() + self.gate.expert_bias  # zeros unless loaded or updated
        if self.expert_groups > 1:  # only the experts of the top_groups groups whose best two score most
            per_group = E // self.expert_groups
            best_two = chooser.view(T, self.expert_groups, per_group).sort(-1, descending=True).values[..., :2]
            groups = best_two.sum(-1).argsort(-1, descending=True)[:, : self.top_groups]
            allowed = torch.zeros(T, self.expert_groups, dtype=torch.bool, device=chooser.device)
            allowed = allowed.scatter(1, groups, True)
            chooser = chooser.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
        if self.node_experts is not None:
            chooser = self.limit_to_node(chooser)
        chosen = torch.topk(chooser, k, dim=-1).indices  # (T, k)
        weights = scores.gather(1, chosen)
        if resolve_normalize_gate(self.normalize_gate, k):
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.routed_scaling_factor

        # 2. fill capacity: all first choices, then all second choices, ... (per routing group)
        chosen_list = chosen.tolist()
        best_score = scores.max(dim=1).values.tolist()  # Tutel's priority: the token's highest score
        position = [[0] * k for _ in range(T)]
        group_size = -(-T // self.routing_groups)
        group_filled = []
        for first in range(0, T, max(1, group_size)):
            filled = [0] * E
            order = list(range(first, min(first + group_size, T)))
            if self.batch_prioritized_routing:
                order.sort(key=lambda t: -best_score[t])  # stable: ties keep token order
            for j in range(k):
                for t in order:
                    e = chosen_list[t][j]
                    position[t][j] = filled[e]
                    filled[e] += 1
            group_filled.append(filled)
        filled = [sum(counts) for counts in zip(*group_filled, strict=True)] if group_filled else [0] * E
        needed = max((max(counts) for counts in group_filled), default=0)
        if f > 0:
            capacity = math.ceil(k * f * group_size / E)
        elif f == 0:
            capacity = needed
        else:
            capacity = min(needed, math.ceil(k * -f * group_size / E))
        kept = torch.tensor(position, dtype=torch.int64, device=chosen.device).reshape(T, k) < capacity

        # 3. each expert processes its kept tokens; outputs are weighted and summed per token
        out = torch.zeros_like(tokens)
        for e in range(E):
            token_ids, choice_ids = torch.where((chosen == e) & kept)
            if token_ids.numel() == 0:
                continue
            expert_out = self.ffn(self.experts, e, tokens[token_ids])
            out.index_add_(0, token_ids, expert_out * weights[token_ids, choice_ids, None].to(out.dtype))
        if self.shared_experts is not None:
            shared = sum(self.ffn(self.shared_experts, s, tokens) for s in range(self.shared_experts.w1.shape[0]))
            if self.shared_expert_gate is not None:  # Qwen2-MoE
                shared = torch.sigmoid(tokens @ self.shared_expert_gate.weight.t()) * shared
            out = out + shared

        # 4. losses and bookkeeping
        self.aux_loss = logits.new_zeros(())
        if self.aux_loss_weight > 0 and T > 0:
            probs = scores if self.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
            share = torch.tensor(filled, dtype=probs.dtype, device=probs.device) / (T * k)
            self.aux_loss = self.aux_loss + self.aux_loss_weight * E * (share * probs.mean(0)).sum()
        if self.z_loss_weight > 0 and T > 0:
            z = torch.logsumexp(logits, -1).pow(2).mean()
            self.aux_loss = self.aux_loss + self.z_loss_weight * z
        if self.expert_bias_update_rate > 0 and self.training:
            load = torch.tensor(filled, dtype=torch.float32, device=self.gate.expert_bias.device)
            if self.global_load is not None:
                load = self.global_load(load)
            with torch.no_grad():
                self.gate.expert_bias += self.expert_bias_update_rate * torch.sign(load.mean() - load)
        self.tokens_per_expert = filled
        self.dropped_per_expert = [sum(max(0, counts[e] - capacity) for counts in group_filled) for e in range(E)]
        self.capacity = capacity
        return out.view(x.shape)
