"""MoELayer: the public entry point. It reads top to bottom as the data flow of DESIGN.md:

route -> encode -> schedule.run (dispatch, experts, combine) -> decode.

Shapes: T tokens on this rank, M model dim, E experts, L local experts (E / W under expert
parallelism, E when replicated), W ranks in the group, C capacity (slots per expert per rank), K top-k.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow.capacity import estimated_needed_capacity
from moeflow.comm.algorithms import distinct_algorithms
from moeflow.comm.groups import ParallelGroups, max_over_ranks
from moeflow.comm.traffic import mark_backward_window
from moeflow.config import (
    ALLTOALL_ALGORITHMS,
    FASTERMOE_REMOTE_SHARE,
    PARM_SCHEDULES,
    SAA,
    MoEConfig,
    ffn_projections,
    resolve_normalize_gate,
    validate_capacity_factor,
    validate_expert_groups,
    validate_r,
    validate_top_k,
)
from moeflow.dispatch import decode, encode, make_dispatch_plan
from moeflow.experts import ExpertFFN, shard_expert_state
from moeflow.kernels import resolve_backend
from moeflow.parallel.dynamic import DynamicPlacementSchedule, InferenceHook, PlacedExperts, PlacedRoutes
from moeflow.parallel.modelled import require_ragged_schedule
from moeflow.parallel.parm import check_mp_group
from moeflow.parallel.placement import ExpertPlacement, expert_kind, gather_full
from moeflow.parallel.redundant import (
    ReplicaRoutes,
    SlotExperts,
    balanced_placement,
    move_slots,
    replica_weights,
    slots_per_rank,
)
from moeflow.parallel.schedules import ParallelSchedule, check_packing, packed_schedule, select_schedule
from moeflow.parallel.shadowing import ShadowPlan, check_shadowing, decide_shadows, run_with_shadows, shadow_weights
from moeflow.parallel.smart import check_smart_pipeline
from moeflow.perf import ClusterProfile, CostModel
from moeflow.perf.pipeline import RegionShape, capacity_chunks
from moeflow.perf.schedules import LOCAL, Plan
from moeflow.perf.shadowing import ShadowPrices, rank_compute_load
from moeflow.pipeline import ExpertExchange, pipelined_experts
from moeflow.planner import PipelinePlanner, PlanChoice
from moeflow.precision import compute_dtype, experts_in
from moeflow.ragged import RaggedFFNCompute
from moeflow.routing import (
    NodeLimit,
    assign_slots,
    build_gate,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
    select_experts,
    updated_expert_bias,
)
from moeflow.stats import ExecutionPlan, PipelineTiming, RoutingStats
from moeflow.workspace import Workspace


@dataclass(frozen=True)
class _GlobalLoad:
    """Routing counts of every rank, exchanged once per forward (one small all-gather)."""

    counts_WE: torch.Tensor  # assignments each rank routes to each expert
    max_tokens_per_rank: int
    estimate_E: np.ndarray | None = None  # an inference hook's estimated selections, summed over ranks

    @property
    def needed_capacity(self) -> int:
        return int(self.counts_WE.max()) if self.counts_WE.numel() else 0


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer with Tutel's API, parallel over a group of ranks.

    ``group`` is a :class:`~moeflow.comm.ParallelGroups` (built once per job from the topology), a
    plain process group (all its ranks count as one node), or None: the default group when
    torch.distributed is initialized, one process otherwise.

    ``parallel`` names the schedule, which also fixes where the expert weights live (its
    :class:`~moeflow.parallel.ExpertPlacement`): ``"expert"`` splits the experts over the group and
    moves tokens by all-to-all; ``"replicated"`` keeps every expert on every rank and moves no
    token (the trainer then sums the expert gradients like any replicated weight); ``"auto"`` ranks
    both for a training step on the calibrated ``profile`` at ``tokens_per_rank_hint`` tokens, and
    keeps ``"expert"`` without them. ``"adaptive"`` or an int is Tutel's switchable parallelism (r
    per iteration or fixed). Behind tensor-parallel attention (``mp_group``, tokens replicated over
    it) ``"s1"``, ``"s2"`` and ``"ds-baseline"`` are Parm's schedules and the DeepSpeed-MoE
    baseline, and ``"auto"`` chooses S1 or S2 per iteration. Under the expert schedule, dispatch ->
    experts -> combine runs pipelined over ``pipeline`` capacity chunks with the ``alltoall``
    algorithm, both planned per forward (:mod:`moeflow.planner`): ``"auto"`` ranks the candidates
    with the profile and times the best few online, ``"model"`` trusts the profile, ``"search"``
    times {1, 2, 4, 8} x algorithms per capacity bucket of ``capacity_bucket`` slots; an int or an
    algorithm name forces it.

    ``gate_precision="input"`` computes the linear gate's logits in x's dtype before the fp32
    scores (Mixtral's and Qwen-MoE's routers); ``normalize_gate=None`` renormalises the k combine
    weights only when k > 1 (Tutel's rule);
    ``bias=False`` gives experts without biases (Mixtral, Qwen-MoE, DeepSeek); shared experts may
    have their own ``shared_hidden_dim`` and Qwen2-MoE's sigmoid ``shared_expert_gate``. ``expert_groups`` /
    ``top_groups`` limit each token to the experts of its best groups and ``routed_scaling_factor``
    scales the combine weights (DeepSeek-V3's router, with ``score_function="sigmoid"``).
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
        normalize_gate: bool | None = None,
        batch_prioritized_routing: bool = False,
        aux_loss_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        group: ParallelGroups | dist.ProcessGroup | None = None,
        *,
        gate_precision: str = "fp32",
        score_function: str = "softmax",
        num_shared_experts: int = 0,
        shared_hidden_dim: int | None = None,
        shared_expert_gate: bool = False,
        expert_bias_update_rate: float = 0.0,
        expert_groups: int = 1,
        top_groups: int = 1,
        routed_scaling_factor: float = 1.0,
        cosine_projection_dim: int = 256,
        cosine_min_temperature: float = 0.01,
        check_finite: bool = False,
        expert_kernel: str = "bmm",
        kernel_backend: str = "auto",
        alltoall: str = "auto",
        pipeline: int | str = "auto",
        capacity_bucket: int = 128,
        bias: bool = True,
        parallel: str | int = "auto",
        tokens_per_rank_hint: int | None = None,
        shadowing: str | Sequence[int] = "off",
        topology_gate: str | float = "off",
        redundant_experts: int = 0,
        profile: ClusterProfile | str | None = None,
        mp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        config = MoEConfig(
            model_dim=model_dim, hidden_dim=hidden_dim, num_experts=num_experts, top_k=top_k,
            capacity_factor=capacity_factor, gate=gate, gate_precision=gate_precision, score_function=score_function,
            activation=activation, normalize_gate=normalize_gate,
            batch_prioritized_routing=batch_prioritized_routing, aux_loss_weight=aux_loss_weight,
            z_loss_weight=z_loss_weight, num_shared_experts=num_shared_experts,
            shared_hidden_dim=shared_hidden_dim, shared_expert_gate=shared_expert_gate,
            expert_bias_update_rate=expert_bias_update_rate, expert_groups=expert_groups, top_groups=top_groups,
            routed_scaling_factor=routed_scaling_factor,
            cosine_projection_dim=cosine_projection_dim, cosine_min_temperature=cosine_min_temperature,
            check_finite=check_finite,
            expert_kernel=expert_kernel, kernel_backend=kernel_backend, alltoall=alltoall, pipeline=pipeline,
            capacity_bucket=capacity_bucket, bias=bias, parallel=parallel,
            tokens_per_rank_hint=tokens_per_rank_hint,
            shadowing=shadowing if isinstance(shadowing, str) else tuple(shadowing),
            topology_gate=topology_gate, redundant_experts=redundant_experts,
        )
        self.config = config
        resolve_normalize_gate(normalize_gate, top_k)  # warns now about an explicit True at k = 1
        self.groups = group if isinstance(group, ParallelGroups) else ParallelGroups.from_group(group)
        self._attach_mp_group(mp_group, parallel)
        self.world_size, self.rank = self.groups.size, self.groups.rank
        self._plan_execution(ClusterProfile.load(profile) if isinstance(profile, str) else profile)
        self.gate = build_gate(
            gate, model_dim, num_experts, cosine_projection_dim, cosine_min_temperature, gate_precision
        )
        local = self.placement.local(self.rank)
        hidden_local = local[0].hidden_stop - local[0].hidden_start
        self.experts = ExpertFFN(len(local), model_dim, hidden_local, activation, expert_kernel, bias)
        shared_hidden = hidden_dim if shared_hidden_dim is None else shared_hidden_dim
        self.shared_experts = (
            ExpertFFN(num_shared_experts, model_dim, shared_hidden, activation, expert_kernel, bias)
            if num_shared_experts
            else None
        )
        self.shared_expert_gate = nn.Linear(model_dim, 1, bias=False) if shared_expert_gate else None
        self.workspace = Workspace()  # the experts' large intermediates, reused step to step
        self.inference_hook: InferenceHook | None = None  # a per-forward placement (schedule_inference)
        self._static: tuple[ParallelSchedule, ExpertPlacement, PipelinePlanner] | None = None
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.last_stats: RoutingStats | None = None

    def _plan_execution(self, profile: ClusterProfile | None) -> None:
        """The schedule (and with it the placement of the weights) and the per-iteration planner."""
        c = self.config
        self.cost_model = CostModel(profile) if profile is not None else None
        if c.alltoall == SAA and (self.groups.model is None or c.parallel in ("s1", "ds-baseline")):
            raise ValueError(
                "alltoall='saa' overlaps Parm's S2 combine with the MP all-gather: it needs parallel='s2' or "
                "'auto' with mp_group=<the tensor-parallel group>; use alltoall='linear' or 'auto'"
            )
        if c.alltoall not in ("linear", SAA, "auto") and self.world_size > 1 and not self.groups.is_world:
            raise ValueError(
                f"alltoall={c.alltoall!r} runs on the default (world) process group, where ranks are "
                "numbered node-major; use alltoall='linear' with a custom group"
            )
        mp_size = check_mp_group(self.groups) if self.groups.model is not None else 1
        algorithms = self._candidate_algorithms(mp_size > 1)
        choice = select_schedule(
            c.parallel, c.num_experts, self.world_size, self.cost_model, self._hint_shape(algorithms), algorithms,
            c.pipeline, mp_size,
        )
        self.schedule, self.schedule_reason = choice.schedule, choice.reason
        if c.expert_kernel == "ragged":
            require_ragged_schedule(self.schedule.name)
        self.placement = self.schedule.placement(c.num_experts, self.world_size, c.hidden_dim)
        if c.redundant_experts:  # EPLB's slots, balanced for an even load until the first rebalance
            slots = slots_per_rank(c.redundant_experts, c.num_experts, self.world_size, self.schedule.name)
            self.placement = balanced_placement([1.0] * c.num_experts, slots, self.groups.topology, c.hidden_dim)
        self._replicas_equal = not c.redundant_experts  # replicas copy their primary before the first forward
        check_smart_pipeline(c.pipeline, self.schedule.name, self.groups)
        check_shadowing(c.shadowing, self.schedule.name, self.cost_model)
        self.node_limit = self._node_limit()
        self.planner = self._planner(algorithms)

    def _planner(self, algorithms: tuple[str, ...]) -> PipelinePlanner:
        """The per-iteration planner of this layer's schedule (degree and all-to-all)."""
        c = self.config
        return PipelinePlanner(
            c.pipeline, algorithms, self.cost_model, self._reduce_max() if self.world_size > 1 else None,
            c.capacity_bucket, schedule=self.schedule.model,
        )

    def _attach_mp_group(self, mp_group: dist.ProcessGroup | None, parallel: str | int) -> None:
        """Parm's schedules run behind tensor-parallel attention over ``mp_group`` (``auto`` then
        chooses between S1 and S2); the others have no use for one."""
        if mp_group is None:
            if parallel in PARM_SCHEDULES and self.groups.model is None:
                raise ValueError(f"parallel={parallel!r} needs mp_group=<the tensor-parallel group of the attention>")
            if self.groups.model is not None and parallel not in (*PARM_SCHEDULES, "auto"):
                raise ValueError(
                    f"the ParallelGroups passed as group have a model (tensor-parallel) group, which only Parm's "
                    f"schedules use; got parallel={parallel!r}: use 'auto' or one of {PARM_SCHEDULES}"
                )
            return
        if parallel not in (*PARM_SCHEDULES, "auto"):
            raise ValueError(
                f"mp_group is used by Parm's schedules (parallel='auto' or "
                f"{' or '.join(map(repr, PARM_SCHEDULES))}); got parallel={parallel!r}"
            )
        if self.groups.model is not None and self.groups.model != mp_group:
            raise ValueError("mp_group differs from the model group of the ParallelGroups passed as group")
        self.groups.model = mp_group

    @classmethod
    def from_config(
        cls, config: MoEConfig, group: ParallelGroups | dist.ProcessGroup | None = None,
        profile: ClusterProfile | str | None = None,
    ) -> MoELayer:
        """The layer a :class:`MoEConfig` describes (what a model's config embeds)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(MoEConfig)}, group=group, profile=profile)

    @property
    def num_local_experts(self) -> int:
        return self.experts.num_experts

    def forward(
        self, x: torch.Tensor, top_k: int | None = None, capacity_factor: float | None = None,
        r: int | None = None,
    ) -> torch.Tensor:
        """``r`` (Tutel's ``adaptive_r``) runs this call with that r, on a layer whose ``parallel`` is
        ``"adaptive"`` or an int: switching moves no weight. Every rank must pass the same r. Under
        autocast (or with bf16/fp16 x over fp32 parameters) the experts compute in that dtype and
        the router in fp32 (:mod:`moeflow.precision`)."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dtype = compute_dtype(x, self.experts.w1.dtype) if x.is_floating_point() else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return self._forward(x.to(dtype), top_k, capacity_factor, r)

    def _forward(
        self, x: torch.Tensor, top_k: int | None, capacity_factor: float | None, r: int | None
    ) -> torch.Tensor:
        config = self.config
        if r is not None:
            self._check_call_r(r)
        k = validate_top_k(config.top_k if top_k is None else top_k, config.num_experts)
        validate_expert_groups(config.expert_groups, config.top_groups, config.num_experts, k)
        factor = validate_capacity_factor(
            config.capacity_factor if capacity_factor is None else capacity_factor
        )
        x_TM = self._backward_window(self._tokens(x), entering=True)
        if not self._replicas_equal:
            self.apply_placement(self.placement)
        hook = self.inference_hook
        estimate_E = hook.estimate(x_TM.shape[0]) if hook is not None else None  # before the gate: Lina's phase 1

        # route
        logits_TE = self.gate(x_TM)
        updates_bias = config.expert_bias_update_rate > 0
        normalize = config.normalize_gate if config.normalize_gate is not None else k > 1
        choice = select_experts(
            logits_TE, k, config.score_function, normalize, self.gate.expert_bias,  # zeros unless set or updated
            config.expert_groups, config.top_groups, config.routed_scaling_factor, self._checked_node_limit(k),
        )
        if hook is not None:
            choice = hook.routed(choice, config.num_experts, self.rank)
        self.aux_loss = self._router_loss(logits_TE, choice.scores_TE, choice.expert_idx_TK)
        priority_TK = choice.scores_TK if config.batch_prioritized_routing else None
        location_TK, counts_E = assign_slots(choice.expert_idx_TK, config.num_experts, priority_TK)
        load = self._exchange_load(counts_E, x_TM.shape[0], estimate_E)
        capacity = expert_capacity(
            factor, k, load.max_tokens_per_rank, config.num_experts, load.needed_capacity
        )
        filled_WE = load.counts_WE.clamp(max=capacity)  # every rank's kept tokens per expert
        routes = ReplicaRoutes.of(self.placement, filled_WE, capacity, self.rank) if config.redundant_experts else None
        placed = self._placed_experts(hook, load, filled_WE, capacity, x_TM.dtype) if hook is not None else None
        chosen, timing = self.planner.choose(
            self._region(self._exchanged_capacity(capacity, routes), x_TM.element_size(), load.max_tokens_per_rank,
                         load.needed_capacity),
            backward=torch.is_grad_enabled(), r=r,
        )
        if chosen.source == "trial" and x_TM.is_cuda:  # the trial compares device time, not queueing time
            timing.synced_device = str(x_TM.device)
        # the tokens this rank encodes and decodes (Parm's S1: this MP member's share)
        share = self.schedule.token_share(chosen.plan, self.groups, config.num_experts, timing)
        owned = share.own(x_TM, choice.weights_TK, choice.expert_idx_TK, location_TK, capacity)
        plan = make_dispatch_plan(owned.expert_idx_TK, owned.location_TK, config.num_experts, owned.capacity)

        # encode -> schedule.run (dispatch -> experts -> combine, pipelined) -> decode
        self.workspace.start_step()
        backend = resolve_backend(config.kernel_backend, x_TM.device)
        dispatched_ECM = encode(owned.x_TM, plan, self.workspace, backend)
        shadow, shadow_gain = self._shadows(filled_WE, capacity, chosen.plan.algorithm)
        if placed is not None:
            combined_ECM = self.schedule.run(chosen.plan, dispatched_ECM, placed, self.groups, timing)
        elif routes is not None:
            combined_ECM = self._run_slots(chosen.plan, dispatched_ECM, timing, routes)
        else:
            combined_ECM = self._run_experts(chosen.plan, dispatched_ECM, timing, filled_WE, shadow)
        y_TM = share.output(decode(combined_ECM, owned.weights_TK, plan, self.workspace, backend), x_TM.shape[0])

        if self.shared_experts is not None:
            shared_input_STM = x_TM.unsqueeze(0).expand(self.shared_experts.num_experts, -1, -1)
            shared_TM = self.shared_experts(shared_input_STM).sum(dim=0)
            if self.shared_expert_gate is not None:
                shared_TM = torch.sigmoid(F.linear(x_TM, self.shared_expert_gate.weight.to(x_TM.dtype))) * shared_TM
            y_TM = y_TM + shared_TM

        if updates_bias and self.training:
            with torch.no_grad():
                self.gate.expert_bias.copy_(
                    updated_expert_bias(
                        self.gate.expert_bias, load.counts_WE.sum(0), config.expert_bias_update_rate
                    )
                )
        rank_tokens = placed.routes.rank_tokens if placed is not None else self._rank_tokens(filled_WE, shadow, routes)
        self.last_stats = dataclasses.replace(
            self._stats(load, capacity, k, factor, chosen, timing, owned.capacity),
            shadowed_experts=shadow.experts if shadow else (), shadow_predicted_gain_s=shadow_gain,
            rank_tokens=rank_tokens,
        )
        return self._backward_window(y_TM, entering=False).view(x.shape)

    # -- steps ---------------------------------------------------------------------------------

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Validate x and flatten it to (T, M)."""
        model_dim = self.config.model_dim
        if x.dim() < 1 or x.shape[-1] != model_dim:
            raise ValueError(
                f"x has shape {tuple(x.shape)}; its last dimension must be model_dim={model_dim}"
            )
        if not x.is_floating_point():
            raise ValueError(f"x has dtype {x.dtype}; MoELayer needs a floating-point input")
        if self.config.check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or inf values (check_finite=True)")
        return x.reshape(-1, model_dim)

    def _backward_window(self, x: torch.Tensor, entering: bool) -> torch.Tensor:
        """Between the backward of the output (the combine) and of the input, this layer's
        all-to-alls are imminent: Lina's gradient scheduler holds its all-reduces meanwhile."""
        return x if self.world_size == 1 else mark_backward_window(x, self.groups.traffic, entering)

    def _run_experts(
        self, plan: Plan, dispatched_ECM: torch.Tensor, timing: PipelineTiming, filled_WE: torch.Tensor,
        shadow: ShadowPlan | None,
    ) -> torch.Tensor:
        """The schedule's dispatch -> experts -> combine; with shadowed experts, those run here on
        this rank's own tokens and only the others go through the schedule."""
        exchanged_WE = filled_WE if shadow is None else shadow.exchanged(filled_WE)  # owners skip shadows
        ragged = self._ragged_compute(exchanged_WE)
        experts = experts_in(self.experts, dispatched_ECM.dtype)

        def run_exchanged(buffer_ECM: torch.Tensor) -> torch.Tensor:
            return self.schedule.run(plan, buffer_ECM, experts, self.groups, timing, self.workspace, ragged)

        if shadow is None:
            return run_exchanged(dispatched_ECM)
        weights = shadow_weights(experts.weights(), self.placement, self.rank, shadow.experts, self.groups.expert)
        local = self._ragged_compute(filled_WE, own_tokens_of=shadow.experts) or self.experts.compute
        return run_with_shadows(shadow, dispatched_ECM, weights, local, run_exchanged)

    def _run_slots(
        self, plan: Plan, dispatched_ECM: torch.Tensor, timing: PipelineTiming, routes: ReplicaRoutes
    ) -> torch.Tensor:
        """EPLB's slots: each replica gets its share of an expert's tokens; the tokens for other
        ranks' slots run through the expert schedule as a (P, C', M) buffer, those for this rank's
        own slots here, and both return to the (E, C, M) layout."""
        replicas = replica_weights(self.experts, self.placement, self.rank, self.groups.expert)
        weights = replicas.cast(dispatched_ECM.dtype)
        slots = SlotExperts(self.experts.compute, self.num_local_experts, weights)
        mine = slice(self.rank * slots.num_experts, (self.rank + 1) * slots.num_experts)
        exchanged_PCM = self.schedule.run(
            plan, routes.gather(dispatched_ECM, routes.exchanged_rows_PC), slots, self.groups, timing,
            self.workspace, self._ragged_slots(routes.exchanged_WP[:, mine].t()),
        )
        own_WS = routes.filled_WP[self.rank, mine].unsqueeze(1)
        local_SCM = pipelined_experts(
            routes.gather(dispatched_ECM, routes.local_rows_SC), self._ragged_slots(own_WS) or self.experts.compute,
            weights, ExpertExchange(None, LOCAL, slots.num_experts), 1,
        )
        return routes.scatter(exchanged_PCM, local_SCM, self.config.num_experts)

    def _ragged_slots(self, filled_LW: torch.Tensor) -> RaggedFFNCompute | None:
        if self.config.expert_kernel != "ragged":
            return None
        return RaggedFFNCompute(
            self.experts.compute, filled_LW.contiguous(), keeps_activations=torch.is_grad_enabled(),
            backend=resolve_backend(self.config.kernel_backend, self.experts.w1.device),
        )

    def _exchanged_capacity(self, capacity: int, routes: ReplicaRoutes | None) -> int:
        """The per-expert capacity of the same bytes as the exchanged buffer (the planner's shape)."""
        if routes is None:
            return capacity
        slots, width = routes.exchanged_rows_PC.shape
        return -(-slots * width // self.config.num_experts)

    def _rank_tokens(
        self, filled_WE: torch.Tensor, shadow: ShadowPlan | None, routes: ReplicaRoutes | None
    ) -> tuple[int, ...]:
        """The assignments each rank's experts compute: a slot's, an owner's, or, for a shadowed
        expert, each rank its own."""
        if routes is not None:
            return tuple(routes.filled_WP.view(self.world_size, self.world_size, -1).sum(dim=(0, 2)).tolist())
        if self.schedule.name != "expert":
            return ()
        owners = [self.placement.holders(e)[0] for e in range(self.config.num_experts)]
        load_W = rank_compute_load(filled_WE.cpu().numpy(), owners, set(shadow.experts) if shadow else set())
        return tuple(int(tokens) for tokens in load_W)

    # -- redundant experts ---------------------------------------------------------------------

    @torch.no_grad()
    def rebalance(self, load_E: Sequence[float], optimizer: torch.optim.Optimizer | None = None) -> bool:
        """EPLB: place the slots for ``load_E`` (tokens per expert, the same on every rank, e.g. the
        recorded ``tokens_per_expert`` of the last steps) and move the weights and ``optimizer``'s
        state once if the placement changed; return whether it did (a collective)."""
        c = self.config
        if not c.redundant_experts:
            raise ValueError("rebalance() places redundant experts: build the layer with redundant_experts > 0")
        if len(load_E) != c.num_experts:
            raise ValueError(f"load_E has {len(load_E)} entries; it needs one per expert ({c.num_experts})")
        new = balanced_placement(load_E, self.num_local_experts, self.groups.topology, c.hidden_dim)
        if new == self.placement:
            return False
        self.apply_placement(new, optimizer)
        return True

    @torch.no_grad()
    def apply_placement(self, placement: ExpertPlacement, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Rewrite the slots for ``placement`` (each from its expert's primary copy), with every
        optimizer state tensor shaped like its parameter (AdamW's moments); a collective."""
        old = self.placement
        for kind, parameter in list(self.experts.named_parameters()):
            state = optimizer.state.get(parameter, {}) if optimizer is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == parameter.shape:
                    state[key] = move_slots(value, kind, old, placement, self.rank, self.groups.expert)
            moved = move_slots(parameter, kind, old, placement, self.rank, self.groups.expert)
            if moved.shape == parameter.shape:
                parameter.copy_(moved)
            else:  # more or fewer slots (packing): a new Parameter, in the optimizer's place of the old
                self._replace_expert_parameter(kind, parameter, moved, optimizer)
        self.placement = placement
        self._replicas_equal = True

    def _replace_expert_parameter(
        self, kind: str, old: nn.Parameter, value: torch.Tensor, optimizer: torch.optim.Optimizer | None
    ) -> None:
        """A reshaped expert parameter is a new Parameter (autograd keeps a leaf's shape), which takes
        the old one's place and state in ``optimizer``."""
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        setattr(self.experts, kind, new)
        if optimizer is None:
            return
        for group in optimizer.param_groups:
            group["params"] = [new if p is old else p for p in group["params"]]
        if old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)

    # -- Lina's inference scheduling ------------------------------------------------------------

    @torch.no_grad()
    def schedule_inference(self, hook: InferenceHook | None) -> None:
        """With a hook (:class:`moeflow.inference.LayerScheduling`), every rank gathers every expert's
        weights (a collective) and each forward computes the experts of the placement the hook
        chooses for that forward (:class:`~moeflow.parallel.dynamic.DynamicPlacementSchedule`);
        None puts the layer's own placement back (a collective)."""
        c = self.config
        if hook is None:
            if self._static is not None:
                schedule, placement, planner = self._static
                self.apply_placement(placement)
                self.schedule, self.planner, self._static = schedule, planner, None
            self.inference_hook = None
            return
        if self._static is None:
            self._check_schedulable()
            self._static = (self.schedule, self.placement, self.planner)
            self.apply_placement(ExpertPlacement.replicated(c.num_experts, self.world_size, c.hidden_dim))
            self.schedule = DynamicPlacementSchedule()
            self.planner = PipelinePlanner(1, ("linear",), None, self._reduce_max() if self.world_size > 1 else None,
                                           c.capacity_bucket, schedule=self.schedule.model)
        self.inference_hook = hook

    def _check_schedulable(self) -> None:
        c = self.config
        others = {"shadowing": c.shadowing != "off", "redundant_experts": c.redundant_experts > 0,
                  "topology_gate": c.topology_gate != "off", "mp_group": self.groups.model is not None,
                  f"parallel={self.schedule.name!r}": self.schedule.name not in ("expert", "replicated")}
        if clash := [name for name, on in others.items() if on]:
            raise ValueError(f"inference scheduling places the experts per batch over whole experts; this layer "
                             f"uses {', '.join(clash)}: build it with parallel='expert' and those off")

    def _placed_experts(
        self, hook: InferenceHook, load: _GlobalLoad, filled_WE: torch.Tensor, capacity: int, dtype: torch.dtype
    ) -> PlacedExperts:
        """This forward's placement from the hook, and the rows each rank computes under it."""
        placement = hook.placement(filled_WE.sum(0), load.estimate_E, self.world_size, self.config.hidden_dim)
        routes = PlacedRoutes.of(placement, filled_WE, capacity, self.rank)
        return PlacedExperts(self.experts.compute, self.experts.weights().cast(dtype), placement, routes, self.rank)

    @property
    def experts_per_rank(self) -> int:
        return self.placement.num_local(self.rank)

    @torch.no_grad()
    def pack(self, experts_per_rank: int, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Lina's expert packing: hold ``experts_per_rank`` experts on every rank, in blocks of
        E / experts_per_rank ranks that each hold all experts (their all-to-alls stay inside the
        block), moving the weights and the optimizer state once; return whether the placement
        changed (a collective). E / W experts per rank is expert parallelism again."""
        c = self.config
        check_packing(c, self.schedule.name, self.world_size, experts_per_rank)
        group_size = c.num_experts // experts_per_rank
        placement = ExpertPlacement.packed(c.num_experts, self.world_size, group_size, c.hidden_dim)
        if placement == self.placement:
            return False
        self.apply_placement(placement, optimizer)
        self.schedule = packed_schedule(group_size, self.world_size)
        whole = group_size == self.world_size  # a block's all-to-all runs on a subgroup: linear
        self.planner = self._planner(self._candidate_algorithms(False) if whole else ("linear",))
        return True

    def _shadows(
        self, filled_WE: torch.Tensor, capacity: int, algorithm: str
    ) -> tuple[ShadowPlan | None, float | None]:
        """FasterMoE's shadowed experts of this iteration (the same on every rank) and the gain the
        cost model predicts for them."""
        c = self.config
        if c.shadowing == "off" or self.world_size == 1:
            return None, None
        prices = None if self.cost_model is None else ShadowPrices.from_cost_model(
            self.cost_model, c.model_dim, c.hidden_dim, ffn_projections(c.activation), algorithm=algorithm,
        )
        return decide_shadows(c.shadowing, filled_WE, self.placement, capacity, prices)

    def _ragged_compute(
        self, filled_WE: torch.Tensor, own_tokens_of: Sequence[int] | None = None
    ) -> RaggedFFNCompute | None:
        """With ``expert_kernel="ragged"``: the compute that runs each expert on its filled slots
        only (how many of each source rank's slots hold a token, from the exchanged counts): this
        rank's local experts, or ``own_tokens_of`` these experts on this rank's own tokens (shadowed
        ones; under the replicated schedule, every expert)."""
        if self.config.expert_kernel != "ragged":
            return None
        local = [shard.expert for shard in self.placement.local(self.rank)]
        if own_tokens_of is None and self.schedule.name == "replicated":
            own_tokens_of = local
        if own_tokens_of is not None:
            filled_LW = filled_WE[self.rank, list(own_tokens_of)].unsqueeze(1)
        else:  # the ranks this rank's experts receive from: the group, or a packed block of it
            block = self.config.num_experts // len(local) if self.schedule.name == "packed" else self.world_size
            first = self.rank // block * block
            filled_LW = filled_WE[first : first + block, local].t()
        return self._ragged_slots(filled_LW)

    def _node_limit(self) -> NodeLimit | None:
        """FasterMoE's topology-aware gate for this rank: the experts on its node and the share of
        its tokens that may pick others (``topology_gate``, or W_net / (M W_local) from the profile)."""
        setting = self.config.topology_gate
        if setting == "off":
            return None
        if self.schedule.name != "expert":
            raise ValueError(
                f"topology_gate limits the tokens the expert-parallel schedule sends across nodes; this layer runs "
                f"parallel={self.schedule.name!r}: use parallel='expert' or topology_gate='off'"
            )
        share = setting if setting != "auto" else (
            self.cost_model.remote_token_share() if self.cost_model is not None else None
        )
        if share is None:
            raise ValueError(
                "topology_gate='auto' takes W_net / (M W_local) from a profile with intra- and inter-node all-to-all "
                "fits (calibrated with 2+ ranks per node): pass such a profile or the share itself, e.g. "
                f"topology_gate={FASTERMOE_REMOTE_SHARE}"
            )
        topology = self.groups.topology
        node = topology.node_of(self.rank)
        local_E = torch.tensor([
            topology.node_of(self.placement.holders(expert)[0]) == node for expert in range(self.config.num_experts)
        ])
        return NodeLimit(local_E, float(share))

    def _checked_node_limit(self, top_k: int) -> NodeLimit | None:
        limit = self.node_limit
        if limit is not None and int(limit.local_E.sum()) < top_k:
            raise ValueError(
                f"topology_gate: a node holds {int(limit.local_E.sum())} experts, fewer than top_k={top_k}, so its "
                "tokens cannot all choose within it; use more experts per node, a smaller top_k or topology_gate='off'"
            )
        return limit

    def _check_call_r(self, r: object) -> None:
        if self.schedule.name != "adaptive":
            raise ValueError(
                f"r={r!r} switches Tutel's parallelism, which needs MoELayer(..., parallel='adaptive' or an int r); "
                f"this layer runs parallel={self.schedule.name!r}"
            )
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"r must be an integer, got {r!r}")
        validate_r(r, self.config.num_experts, self.world_size)

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

    def _exchange_load(self, counts_E: torch.Tensor, num_tokens: int, estimate_E: np.ndarray | None) -> _GlobalLoad:
        """Every rank learns every rank's routing counts: capacity must agree across ranks. An
        inference hook's estimate rides along (as float64, which holds the counts exactly)."""
        local = torch.cat([counts_E, counts_E.new_tensor([num_tokens])])
        if estimate_E is not None:
            estimate = torch.from_numpy(np.asarray(estimate_E, dtype=np.float64))
            local = torch.cat([local.double(), estimate.to(local.device)])
        if self.groups.expert is None:
            gathered = local.unsqueeze(0).cpu()
        else:
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local, group=self.groups.expert)
            gathered = torch.stack(parts).cpu()
        experts = counts_E.shape[0]
        return _GlobalLoad(
            counts_WE=gathered[:, :experts].to(counts_E.dtype), max_tokens_per_rank=int(gathered[:, experts].max()),
            estimate_E=None if estimate_E is None else gathered[:, experts + 1:].sum(0).numpy(),
        )

    def _candidate_algorithms(self, behind_mp: bool) -> tuple[str, ...]:
        """The all-to-alls the planner may pick: the forced one; behind tensor-parallel attention,
        Parm's plain and overlapped (SAA) combines; linear on a custom group; those a profile
        measured; otherwise those that differ from linear on this topology."""
        config = self.config
        if config.alltoall != "auto":
            return (config.alltoall,)
        if behind_mp:
            return ("linear", SAA)
        if not self.groups.is_world:
            return ("linear",)
        if self.cost_model is not None and config.pipeline != "search":
            return ALLTOALL_ALGORITHMS
        return distinct_algorithms(self.groups.topology)

    def _reduce_max(self) -> Callable[[Sequence[float]], list[float]]:
        """The slowest rank's times, for the planner (which imports no torch.distributed)."""
        group = self.groups.expert
        assert group is not None
        return lambda values: max_over_ranks(values, group)

    def _region(self, capacity: int, bytes_per_element: int, tokens: int = 0, needed: int = 0) -> RegionShape:
        c = self.config
        return RegionShape(
            c.num_experts, self.world_size, capacity, c.model_dim, c.hidden_dim, bytes_per_element,
            ffn_projections(c.activation), c.bias, tokens, needed,
        )

    def _hint_shape(self, algorithms: tuple[str, ...]) -> RegionShape | None:
        """The region at ``tokens_per_rank_hint`` tokens (balanced load), for ``parallel='auto'``;
        None when the profile cannot predict the expert schedule."""
        c = self.config
        cost = self.cost_model
        fits = cost.profile.fits if cost is not None else {}
        if c.tokens_per_rank_hint is None or "gemm" not in fits or not any(f"alltoall.{a}" in fits for a in algorithms):
            return None
        needed = estimated_needed_capacity(c.top_k, c.tokens_per_rank_hint, c.num_experts)
        capacity = expert_capacity(c.capacity_factor, c.top_k, c.tokens_per_rank_hint, c.num_experts, needed)
        return self._region(capacity, 4)

    def _stats(
        self, load: _GlobalLoad, capacity: int, top_k: int, factor: float, chosen: PlanChoice,
        timing: PipelineTiming, slots: int,
    ) -> RoutingStats:
        counts_WE = load.counts_WE
        if self.groups.model is not None:  # MP members hold the same tokens: count them once
            counts_WE = counts_WE[:: dist.get_world_size(self.groups.model)]
        dropped_E = (counts_WE - capacity).clamp(min=0).sum(0)
        plan = ExecutionPlan(
            schedule=self.schedule.name if self.schedule.name in ("packed", "dynamic") else chosen.plan.schedule,
            r=chosen.plan.r,
            alltoall=chosen.plan.algorithm,
            pipeline_degree=len(capacity_chunks(slots, chosen.plan.degree)),
            requested_degree=chosen.plan.degree,
            policy=self.config.pipeline,
            source=chosen.source,
            world_size=self.world_size,
            expert_kernel=self.config.expert_kernel,
            capacity_key=chosen.key,
            predicted_forward_s=chosen.predicted_forward_s,
            predicted_backward_s=chosen.predicted_backward_s,
            predicted_gradient_sync_s=chosen.predicted_gradient_sync_s,
            slots=slots,
        )
        return RoutingStats(
            num_tokens=int(counts_WE.sum()) // top_k,
            top_k=top_k,
            capacity=capacity,
            capacity_factor=factor,
            tokens_per_expert=counts_WE.sum(0).tolist(),
            dropped_per_expert=dropped_E.tolist(),
            plan=plan,
            timing=timing,
        )

    # -- state with all E experts ----------------------------------------------------------------

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a state dict that holds all E experts (a single-process run's, a checkpoint's, a
        converted Hugging Face model's), keeping this rank's part of the placement."""
        self.load_state_dict(shard_expert_state(state_dict, self.placement, self.rank), strict=strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The state with all E experts, on every rank (a collective over the expert group: each
        rank contributes its primary shards, one all-reduce per expert tensor)."""
        full: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            kind = expert_kind(name)
            if kind is None:
                full[name] = tensor.detach().clone()
                continue
            full[name] = gather_full(tensor, self.placement, kind, self.rank, self.groups.expert)
        return full

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"model_dim={c.model_dim}, hidden_dim={c.hidden_dim}, num_experts={c.num_experts} "
            f"({self.num_local_experts} local of {self.world_size} ranks, {self.schedule.name}), top_k={c.top_k}, "
            f"capacity_factor={c.capacity_factor}, gate={c.gate}, activation={c.activation}"
        )
