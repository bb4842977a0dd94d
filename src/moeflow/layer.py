"""MoELayer: the public entry point. It reads top to bottom as the data flow of DESIGN.md:

route -> encode -> dispatch (all-to-all) -> experts -> combine (all-to-all) -> decode.

Shapes: T tokens on this rank, M model dim, E experts, L = E / W local experts, W ranks in the
group, C capacity (slots per expert per rank), K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moeflow.comm import group_rank, group_size, resolve_group
from moeflow.comm.algorithms import distinct_algorithms
from moeflow.comm.topology import topology_from_env
from moeflow.config import ALLTOALL_ALGORITHMS, MoEConfig, validate_capacity_factor, validate_top_k
from moeflow.dispatch import decode, encode, make_dispatch_plan
from moeflow.experts import ExpertFFN
from moeflow.perf import ClusterProfile, CostModel
from moeflow.perf.pipeline import RegionShape, capacity_chunks
from moeflow.pipeline import ExpertExchange, pipelined_experts
from moeflow.planner import PipelinePlanner, PlanChoice
from moeflow.routing import (
    assign_slots,
    build_gate,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
    select_experts,
    updated_expert_bias,
)
from moeflow.stats import PipelineTiming, RoutingStats


@dataclass(frozen=True)
class _GlobalLoad:
    """Routing counts of every rank, exchanged once per forward (one small all-gather)."""

    counts_WE: torch.Tensor  # assignments each rank routes to each expert
    max_tokens_per_rank: int

    @property
    def needed_capacity(self) -> int:
        return int(self.counts_WE.max()) if self.counts_WE.numel() else 0


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer with Tutel's API, expert-parallel over a group.

    Dispatch -> experts -> combine runs pipelined over ``pipeline`` capacity chunks with the
    ``alltoall`` algorithm; both are planned per forward (:mod:`moeflow.planner`): ``"auto"`` ranks
    the candidates with a calibrated ``profile`` (a :class:`~moeflow.perf.ClusterProfile` or the
    path of one) and times the best few online, ``"model"`` trusts the profile, ``"search"`` times
    {1, 2, 4, 8} x algorithms per capacity bucket of ``capacity_bucket`` slots; an int or an
    algorithm name forces that setting.
    ``group=None`` uses the default process group when torch.distributed is initialized and runs
    single-process otherwise. Expert e lives on rank e // L at local index e % L.
    After each forward, ``aux_loss`` holds the weighted balance (+ z) loss, in the graph, and
    ``last_stats`` a :class:`~moeflow.stats.RoutingStats`.
    """

    def __init__(
        self,
        model_dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.0,
        gate: str = "softmax",
        activation: str = "gelu",
        normalize_gate: bool = True,
        batch_prioritized_routing: bool = False,
        aux_loss_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        group: dist.ProcessGroup | None = None,
        *,
        score_function: str = "softmax",
        num_shared_experts: int = 0,
        expert_bias_update_rate: float = 0.0,
        cosine_projection_dim: int = 256,
        check_finite: bool = False,
        expert_kernel: str = "bmm",
        alltoall: str = "auto",
        pipeline: int | str = "auto",
        capacity_bucket: int = 128,
        profile: ClusterProfile | str | None = None,
    ) -> None:
        super().__init__()
        config = MoEConfig(
            model_dim=model_dim, hidden_dim=hidden_dim, num_experts=num_experts, top_k=top_k,
            capacity_factor=capacity_factor, gate=gate, score_function=score_function,
            activation=activation, normalize_gate=normalize_gate,
            batch_prioritized_routing=batch_prioritized_routing, aux_loss_weight=aux_loss_weight,
            z_loss_weight=z_loss_weight, num_shared_experts=num_shared_experts,
            expert_bias_update_rate=expert_bias_update_rate,
            cosine_projection_dim=cosine_projection_dim, check_finite=check_finite,
            expert_kernel=expert_kernel, alltoall=alltoall, pipeline=pipeline,
            capacity_bucket=capacity_bucket,
        )
        self.config = config
        self.group = resolve_group(group)
        self.world_size = group_size(self.group)
        self.rank = group_rank(self.group)
        if num_experts % self.world_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the process group size "
                f"{self.world_size}; use a multiple of {self.world_size} experts or a smaller group"
            )
        self.num_local_experts = num_experts // self.world_size
        self.topology = topology_from_env(self.world_size)
        if isinstance(profile, str):
            profile = ClusterProfile.load(profile)
        self.cost_model = CostModel(profile) if profile is not None else None
        if alltoall not in ("linear", "auto") and self.group is not None and self.group != dist.group.WORLD:
            raise ValueError(
                f"alltoall={alltoall!r} runs on the default (world) process group, where ranks are "
                "numbered node-major; use alltoall='linear' with a custom group"
            )
        self.planner = PipelinePlanner(
            pipeline, self._candidate_algorithms(), self.cost_model, self.group, capacity_bucket
        )
        self.gate = build_gate(
            gate, model_dim, num_experts, cosine_projection_dim, config.cosine_min_temperature
        )
        self.experts = ExpertFFN(self.num_local_experts, model_dim, hidden_dim, activation, expert_kernel)
        self.shared_experts = (
            ExpertFFN(num_shared_experts, model_dim, hidden_dim, activation, expert_kernel)
            if num_shared_experts
            else None
        )
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.last_stats: RoutingStats | None = None

    def forward(
        self, x: torch.Tensor, top_k: int | None = None, capacity_factor: float | None = None
    ) -> torch.Tensor:
        config = self.config
        k = validate_top_k(config.top_k if top_k is None else top_k, config.num_experts)
        factor = validate_capacity_factor(
            config.capacity_factor if capacity_factor is None else capacity_factor
        )
        x_TM = self._tokens(x)

        # route
        logits_TE = self.gate(x_TM)
        use_bias = config.expert_bias_update_rate > 0
        choice = select_experts(
            logits_TE, k, config.score_function, config.normalize_gate,
            self.gate.expert_bias if use_bias else None,
        )
        self.aux_loss = self._router_loss(logits_TE, choice.scores_TE, choice.expert_idx_TK)
        priority_TK = choice.scores_TK if config.batch_prioritized_routing else None
        location_TK, counts_E = assign_slots(choice.expert_idx_TK, config.num_experts, priority_TK)
        load = self._exchange_load(counts_E, x_TM.shape[0])
        capacity = expert_capacity(
            factor, k, load.max_tokens_per_rank, config.num_experts, load.needed_capacity
        )
        plan = make_dispatch_plan(choice.expert_idx_TK, location_TK, config.num_experts, capacity)

        # encode -> (dispatch -> experts -> combine, pipelined) -> decode
        dispatched_ECM = encode(x_TM, plan)
        region = RegionShape(
            config.num_experts, self.world_size, capacity, config.model_dim, config.hidden_dim,
            dispatched_ECM.element_size(), config.activation == "swiglu",
        )
        chosen, timing = self.planner.choose(region, backward=torch.is_grad_enabled())
        route = ExpertExchange(
            self.group, self.topology, chosen.plan.algorithm, self.world_size, self.num_local_experts
        )
        combined_ECM = pipelined_experts(dispatched_ECM, self.experts.weights(), route, chosen.plan.degree, timing)
        y_TM = decode(combined_ECM, choice.weights_TK, plan)

        if self.shared_experts is not None:
            shared_input_STM = x_TM.unsqueeze(0).expand(self.shared_experts.num_experts, -1, -1)
            y_TM = y_TM + self.shared_experts(shared_input_STM).sum(dim=0)

        if use_bias and self.training:
            with torch.no_grad():
                self.gate.expert_bias.copy_(
                    updated_expert_bias(
                        self.gate.expert_bias, load.counts_WE.sum(0), config.expert_bias_update_rate
                    )
                )
        self.last_stats = self._stats(load, capacity, k, factor, chosen, timing)
        return y_TM.view(x.shape)

    # -- steps ---------------------------------------------------------------------------------

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Validate x and flatten it to (T, M)."""
        model_dim = self.config.model_dim
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != model_dim:
            raise ValueError(
                f"x has shape {tuple(x.shape)}; its last dimension must be model_dim={model_dim}"
            )
        if not x.is_floating_point():
            raise ValueError(f"x has dtype {x.dtype}; MoELayer needs a floating-point input")
        param_dtype = self.experts.w1.dtype
        if x.dtype != param_dtype:
            raise ValueError(
                f"x has dtype {x.dtype} but the layer's parameters are {param_dtype}; "
                f"cast one to the other (layer.to({x.dtype}) or x.to({param_dtype}))"
            )
        if self.config.check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or inf values (check_finite=True)")
        return x.reshape(-1, model_dim)

    def _router_loss(
        self, logits_TE: torch.Tensor, scores_TE: torch.Tensor, expert_idx_TK: torch.Tensor
    ) -> torch.Tensor:
        config = self.config
        loss = logits_TE.new_zeros(())
        if config.aux_loss_weight > 0:
            balance = load_balancing_loss(scores_TE, expert_idx_TK, config.score_function)
            loss = loss + config.aux_loss_weight * balance
        if config.z_loss_weight > 0:
            loss = loss + config.z_loss_weight * router_z_loss(logits_TE)
        return loss

    def _exchange_load(self, counts_E: torch.Tensor, num_tokens: int) -> _GlobalLoad:
        """Every rank learns every rank's routing counts: capacity must agree across ranks."""
        local = torch.cat([counts_E, counts_E.new_tensor([num_tokens])])
        if self.group is None:
            gathered = local.unsqueeze(0)
        else:
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local, group=self.group)
            gathered = torch.stack(parts).cpu()
        return _GlobalLoad(counts_WE=gathered[:, :-1], max_tokens_per_rank=int(gathered[:, -1].max()))

    def _candidate_algorithms(self) -> tuple[str, ...]:
        """The all-to-alls the planner may pick: the forced one; linear on a custom group; those a
        profile measured; otherwise those that differ from linear on this topology."""
        config = self.config
        if config.alltoall != "auto":
            return (config.alltoall,)
        if self.group is None or self.group != dist.group.WORLD:
            return ("linear",)
        if self.cost_model is not None and config.pipeline != "search":
            return ALLTOALL_ALGORITHMS
        return distinct_algorithms(self.topology)

    def _stats(
        self, load: _GlobalLoad, capacity: int, top_k: int, factor: float, chosen: PlanChoice,
        timing: PipelineTiming,
    ) -> RoutingStats:
        counts_WE = load.counts_WE
        dropped_E = (counts_WE - capacity).clamp(min=0).sum(0)
        return RoutingStats(
            num_tokens=int(counts_WE.sum()) // top_k,
            top_k=top_k,
            capacity=capacity,
            capacity_factor=factor,
            tokens_per_expert=counts_WE.sum(0).tolist(),
            dropped_per_expert=dropped_E.tolist(),
            plan={
                "alltoall": chosen.plan.algorithm,
                "pipeline_degree": len(capacity_chunks(capacity, chosen.plan.degree)),
                "requested_degree": chosen.plan.degree,
                "policy": self.config.pipeline,
                "source": chosen.source,
                "capacity_key": chosen.key,
                "predicted_forward_s": chosen.predicted_forward_s,
                "predicted_backward_s": chosen.predicted_backward_s,
                "expert_kernel": self.config.expert_kernel,
                "world_size": self.world_size,
            },
            timing=timing,
        )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"model_dim={c.model_dim}, hidden_dim={c.hidden_dim}, num_experts={c.num_experts} "
            f"({self.num_local_experts} local of {self.world_size} ranks), top_k={c.top_k}, "
            f"capacity_factor={c.capacity_factor}, gate={c.gate}, activation={c.activation}"
        )
