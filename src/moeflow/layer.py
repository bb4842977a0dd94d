"""MoELayer: the public entry point. It reads top to bottom as the data flow of DESIGN.md:

route -> encode -> schedule.run (dispatch, experts, combine) -> decode.

Shapes: T tokens on this rank, M model dim, E experts, L local experts (E / W under expert
parallelism, E when replicated), W ranks in the group, C capacity (slots per expert per rank), K top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moeflow.capacity import never_drops
from moeflow.comm.groups import ParallelGroups, max_over_ranks
from moeflow.comm.traffic import mark_backward_window
from moeflow.config import TUTEL_POSITIONAL, MoEConfig, call_settings, config_from_arguments, resolve_normalize_gate
from moeflow.direct import DIRECT_LOCAL
from moeflow.direct_packed import DIRECT_PACKED
from moeflow.direct_paths import direct_stats, run_direct
from moeflow.dispatch import decode, encode, make_dispatch_plan
from moeflow.expert_parameters import mark_expert_parameters, refuse_averaging_data_parallel
from moeflow.experts import ExpertFFN, shared_output
from moeflow.forward_memory import ForwardMemory, ForwardRecord, GraphValue, LastForward, recomputing
from moeflow.kernels.choice import KernelChoice, KernelTable
from moeflow.layer_stats import routing_stats
from moeflow.parallel.build import attach_mp_group, build_execution, region_shape
from moeflow.parallel.context import RunContext, ScheduleOutput
from moeflow.parallel.moves import move_experts
from moeflow.parallel.placement import ExpertPlacement, gather_full_state, shard_expert_state
from moeflow.parallel.schedules import ParallelSchedule
from moeflow.parallel.token_share import OwnedTokens
from moeflow.perf import ClusterProfile, CostModel
from moeflow.planner import PipelinePlanner, PlanChoice
from moeflow.precision import checked_tokens, compute_dtype
from moeflow.routing import build_gate
from moeflow.routing.load import GlobalLoad, exchange_load
from moeflow.routing.router import Routing, route, update_expert_bias
from moeflow.sim.layer_ranking import SimulatedRanker
from moeflow.stats import PipelineTiming, RoutingStats
from moeflow.workspace import Workspace


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
        self, config: MoEConfig | int | None = None, *args: Any,
        group: ParallelGroups | dist.ProcessGroup | None = None, profile: ClusterProfile | str | None = None,
        mp_group: dist.ProcessGroup | None = None, **settings: Any,
    ) -> None:
        """``MoELayer(config, group=..., profile=...)``, or Tutel's arguments, which only forward to
        :class:`MoEConfig` (:func:`~moeflow.config.config_from_arguments`; its defaults are the only
        ones): ``MoELayer(model_dim, hidden_dim, num_experts, top_k, ..., group, parallel=...)``."""
        super().__init__()
        if not isinstance(config, MoEConfig):
            if len(args) == len(TUTEL_POSITIONAL):  # Tutel's group, the 12th positional argument
                *args, group = args
            config = config_from_arguments(args if config is None else (config, *args), settings)
        elif args or settings:
            raise TypeError("MoELayer takes a MoEConfig or its settings, not both: pass "
                            "dataclasses.replace(config, ...)")
        self.config = config
        resolve_normalize_gate(config.normalize_gate, config.top_k)  # warns now about an explicit True at k = 1
        self.groups = group if isinstance(group, ParallelGroups) else ParallelGroups.from_group(group)
        attach_mp_group(self.groups, mp_group, config.parallel)
        self.world_size, self.rank = self.groups.size, self.groups.rank
        profile = ClusterProfile.load(profile) if isinstance(profile, str) else profile
        self.cost_model = CostModel(profile) if profile is not None else None
        execution = build_execution(config, self.groups, self.cost_model)
        self.schedule, self.schedule_reason, self.placement = execution.schedule, execution.reason, execution.placement
        self.algorithms, self.node_limit = execution.algorithms, execution.node_limit
        self._replicas_equal = not self.placement.split_tokens  # replicas copy their primary before a forward
        self.planner = self._planner(self.schedule)
        c = config
        self.gate = build_gate(
            c.gate, c.model_dim, c.num_experts, c.cosine_projection_dim, c.cosine_min_temperature, c.gate_precision
        )
        local = self.placement.local(self.rank)
        hidden_local = local[0].hidden_stop - local[0].hidden_start
        self.experts = ExpertFFN(len(local), c.model_dim, hidden_local, c.activation, c.expert_kernel, c.bias,
                                 initialize=False)
        # one draw from the global generator, whatever the placement: ranks seeded alike build the
        # experts one process would, each rank only its own (expert e from the seed and e)
        seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
        self.experts.reset_by_expert(self.placement.local_slices(self.rank), seed, c.hidden_dim)
        mark_expert_parameters(self.experts)  # so that data parallelism leaves them alone
        shared_hidden = c.hidden_dim if c.shared_hidden_dim is None else c.shared_hidden_dim
        self.shared_experts = (
            ExpertFFN(c.num_shared_experts, c.model_dim, shared_hidden, c.activation, c.expert_kernel, c.bias)
            if c.num_shared_experts
            else None
        )
        self.shared_expert_gate = nn.Linear(c.model_dim, 1, bias=False) if c.shared_expert_gate else None
        self.workspace = Workspace()  # the experts' large intermediates, reused step to step (see share_workspace)
        self.kernel_table = KernelTable()  # kernel_backend="auto"'s measured choices (see share_kernel_table)
        self._last = LastForward(GraphValue(torch.zeros(())))  # aux loss and statistics, for reading
        self._memory = ForwardMemory()  # what activation checkpointing's recompute must repeat
        self.index: int | None = None  # its place in its model (the block number), named in hang reports

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (deepcopy, unpickling) marks its experts again: torch copies a Parameter bare."""
        super().__setstate__(state)
        mark_expert_parameters(self.experts)

    @property
    def aux_loss(self) -> torch.Tensor:
        """The last forward's weighted balance (+ z) loss, in its graph: add it to the loss."""
        return self._last.aux_loss.value

    def _planner(self, schedule: ParallelSchedule) -> PipelinePlanner:
        """The per-iteration planner of ``schedule`` (degree and all-to-all) in the space it allows."""
        pipeline, algorithms, cost_model = schedule.plan_space(self.config.pipeline, self.algorithms, self.cost_model)
        reduce_max = self._reduce_max() if self.world_size > 1 else None
        return PipelinePlanner(
            pipeline, algorithms, cost_model, reduce_max, self.config.capacity_bucket, schedule=schedule.model,
            ranker=SimulatedRanker.from_profile,
        )

    @torch.no_grad()
    def switch(
        self, schedule: ParallelSchedule, placement: ExpertPlacement, optimizer: torch.optim.Optimizer | None = None,
        planner: PipelinePlanner | None = None,
    ) -> None:
        """Run ``schedule`` over ``placement`` from the next forward. The expert weights and
        ``optimizer``'s state move when the placement changes (a collective); the planner stays
        while the schedule does, else is ``planner`` or a new one of the schedule's."""
        if placement != self.placement or not self._replicas_equal:
            move_experts(self.experts, self.placement, placement, self.rank, self.groups.expert, optimizer)
            mark_expert_parameters(self.experts)  # a reshaped parameter is a new one
        if planner is None and schedule != self.schedule:
            planner = self._planner(schedule)
        self.schedule, self.placement, self._replicas_equal = schedule, placement, True
        if planner is not None:
            self.planner = planner

    @classmethod
    def from_config(
        cls, config: MoEConfig, group: ParallelGroups | dist.ProcessGroup | None = None,
        profile: ClusterProfile | str | None = None,
    ) -> MoELayer:
        """The layer a :class:`MoEConfig` describes (what a model's config embeds)."""
        return cls(config, group=group, profile=profile)

    @property
    def num_local_experts(self) -> int:
        return self.experts.num_experts

    @property
    def experts_per_rank(self) -> int:
        return self.placement.num_local(self.rank)

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
        with torch.autocast(x.device.type, enabled=False), self.groups.ledger.at(layer=self.index, direction="forward"):
            return self._forward(x.to(dtype), top_k, capacity_factor, r)

    def _forward(
        self, x: torch.Tensor, top_k: int | None, capacity_factor: float | None, r: int | None
    ) -> torch.Tensor:
        config = self.config
        k, factor = call_settings(config, top_k, capacity_factor, r, self.schedule.name, self.schedule.takes_r,
                                  self.world_size)
        x_TM = self._backward_window(checked_tokens(x, config.model_dim, config.check_finite), entering=True)
        self._ready()
        recompute = recomputing()  # activation checkpointing: repeat that forward, count nothing twice
        record = self._memory.start(recompute, self.gate.expert_bias if self._moves_bias else None)
        direct = self._direct_path(x_TM.shape[0], k, factor)  # a no-grad forward that may skip the buffer
        routing, estimate_E = self._route(x_TM, k, recompute, record, slots=direct is None)
        # a small no-grad forward's direct path, or the load every rank agrees -> capacity -> plan
        y_TM, load = self._direct_or_load(x_TM, routing, k, factor, direct, estimate_E, recompute)
        if y_TM is not None:
            return y_TM.view(x.shape)
        capacity = load.capacity(factor, k)
        filled_WE = load.counts_WE.clamp(max=capacity)  # every rank's kept tokens per expert
        prepared = self.schedule.prepare(capacity, filled_WE, self.placement, self.rank)
        region = region_shape(config, self.world_size, prepared.capacity, x_TM.element_size(), load.max_tokens_per_rank,
                              load.needed_capacity)
        chosen, timing = self._memory.plan(
            record, recompute, lambda: self.planner.choose(region, backward=torch.is_grad_enabled(), r=r))
        if chosen.source == "trial" and x_TM.is_cuda:  # the trial compares device time, not queueing time
            timing.synced_device = str(x_TM.device)
        # the tokens this rank encodes and decodes (Parm's S1: this MP member's share)
        share = self.schedule.token_share(chosen.plan, self.groups, config.num_experts, timing)
        owned = share.own(x_TM, routing.slotted(config.num_experts), capacity, factor)
        plan = make_dispatch_plan(owned.expert_idx_TK, owned.location_TK, config.num_experts, owned.capacity,
                                  share.kept_count(filled_WE, self.rank))
        # encode -> schedule.run (dispatch -> experts -> combine, pipelined) -> decode
        workspace = self._step_workspace(recompute)
        kernels = self._kernels(x_TM)
        dispatched_ECM = encode(owned.x_TM, plan, workspace, kernels.encode)
        ctx = self.run_context(x_TM.dtype, timing, filled_WE, capacity, kernels.gemm, load.estimate_E, prepared.state,
                               workspace)
        ran = self.schedule.run(chosen.plan, dispatched_ECM, ctx)
        y_TM = share.output(decode(ran.combined_ECM, owned.weights_TK, plan, workspace, kernels.decode), len(x_TM))
        y_TM = self._with_shared_experts(x_TM, y_TM)

        if not recompute:  # the balancing bias moves, the statistics are this forward's
            self._after_forward(load, capacity, k, factor, chosen, timing, owned, ran, kernels.as_dict())
        return self._backward_window(y_TM, entering=False).view(x.shape)

    def _ready(self) -> None:
        """Refuse a data-parallel wrapper that would average the experts; replicas copy their primary."""
        self._last.checked_data_parallel = refuse_averaging_data_parallel(
            self.experts, self.placement, self._last.checked_data_parallel)
        if not self._replicas_equal:
            self.switch(self.schedule, self.placement)

    def _direct_path(self, num_tokens: int, k: int, factor: float) -> str | None:
        """The schedule's direct path: on one rank for a no-grad forward (no bias to move) that cannot
        drop, else under the ragged kernel the packed path (:mod:`moeflow.direct_packed`, the capacity
        path's slots); the exchange for every forward (the ranks agree in the load all-gather)."""
        path = self.schedule.direct_path(self.placement, self.rank)
        # on several ranks each would decide on its own token count: none may skip a collective
        if path != DIRECT_LOCAL or self.world_size > 1:
            return path if path != DIRECT_LOCAL else None
        if self._asks_direct and never_drops(factor, k, num_tokens, self.config.num_experts):
            return path
        return DIRECT_PACKED if self.config.expert_kernel == "ragged" and not self._moves_bias else None

    def _kernels(self, x_TM: torch.Tensor) -> KernelChoice:
        return self.kernel_table.resolve(self.config.kernel_backend, x_TM.device, x_TM.dtype)

    @property
    def _asks_direct(self) -> bool:
        """Whether this forward may take a direct path: no backward, and no selection bias to move."""
        return not torch.is_grad_enabled() and not self._moves_bias

    def _direct_or_load(self, x_TM: torch.Tensor, routing: Routing, k: int, factor: float, direct: str | None,
                        estimate_E: np.ndarray | None, recompute: bool) -> tuple[torch.Tensor | None, GlobalLoad]:
        """The direct path's output (:mod:`moeflow.direct_paths`), or the load every rank agrees for
        the capacity path (a direct path that declines has gathered it already). A recompute (of the
        packed path) repeats its forward: it moves, resets and counts nothing."""
        if direct is None:
            return None, exchange_load(routing.counts_E, x_TM.shape[0], estimate_E, self.groups)
        timing, kernels = PipelineTiming(), self._kernels(x_TM)
        ran = run_direct(direct, x_TM, routing, k, factor, self.experts, self.groups, kernels, self._last.gather_bucket,
                         timing, self._asks_direct)
        if not recompute:
            self._last.gather_bucket = ran.next_bucket
        if ran.y_TM is None:
            return None, ran.load
        if not recompute:
            self._step_workspace()  # a step begins (without grad: the training buffers no tensor uses go back)
            self._last.stats = functools.partial(direct_stats, ran.load, k, factor, self.schedule.name,
                                                 self.config.pipeline, self.groups.topology, timing, ran.exchange,
                                                 kernels.as_dict())
        return self._with_shared_experts(x_TM, ran.y_TM), ran.load

    @property
    def last_stats(self) -> RoutingStats | None:
        """The last forward's :class:`~moeflow.stats.RoutingStats` (a direct forward's on first read)."""
        if callable(self._last.stats):
            self._last.stats = self._last.stats()
        return self._last.stats

    def _after_forward(
        self, load: GlobalLoad, capacity: int, k: int, factor: float, chosen: PlanChoice, timing: PipelineTiming,
        owned: OwnedTokens, ran: ScheduleOutput, kernels: dict[str, str],
    ) -> None:
        """A forward (not a recompute) moves the loss-free balancing bias and records its statistics."""
        if self._moves_bias:
            update_expert_bias(self.gate, load.counts_WE.sum(0), self.config.expert_bias_update_rate)
        self._last.stats = routing_stats(self.config, self.groups, load, capacity, k, factor, chosen, timing,
                                         self.schedule.plan_label(chosen.plan), owned, ran, kernels)

    @property
    def _moves_bias(self) -> bool:
        """Whether a forward moves the selection bias after routing (loss-free balancing, training)."""
        return self.config.expert_bias_update_rate > 0 and self.training

    def _route(
        self, x_TM: torch.Tensor, top_k: int, recompute: bool, record: ForwardRecord, slots: bool = True
    ) -> tuple[Routing, np.ndarray | None]:
        """This rank's routing (a recompute's with its forward's balancing bias) and, under Lina's
        inference scheduler (the schedule's hook), which sees the gate's choice, its estimate of the
        selections ahead (Lina's phase 1 for the next layer). Keeps the aux loss."""
        hook = self.schedule.hook
        with self._memory.routing_bias(record, self.gate.expert_bias, recompute):
            if hook is None:
                routing, estimate_E = route(self.gate, x_TM, top_k, self.config, self.node_limit, slots=slots), None
            else:
                observe = functools.partial(hook.routed, num_experts=self.config.num_experts, rank=self.rank)
                routing = route(self.gate, x_TM, top_k, self.config, self.node_limit, observe)
                estimate_E = hook.estimate(x_TM.shape[0])
        if not recompute:
            self._last.aux_loss = GraphValue(routing.aux_loss)
        return routing, estimate_E

    def _step_workspace(self, recompute: bool = False) -> Workspace | None:
        """The workspace for a forward whose buffers a backward will use; a no-grad forward
        (evaluation, generation) allocates plainly, so its transient buffers go back at once instead
        of staying in every layer until its next forward (L layers would keep L sets), and the
        training buffers that no tensor uses go back first (an evaluation would add to them)."""
        if not torch.is_grad_enabled():
            self.workspace.release()
            return None
        if not recompute:  # a recompute belongs to the step whose backward runs it
            self.workspace.start_step(id(self))
        return self.workspace

    def run_context(
        self, dtype: torch.dtype, timing: PipelineTiming, filled_WE: torch.Tensor, capacity: int, backend: str,
        estimate_E: np.ndarray | None = None, prepared: object | None = None, workspace: Workspace | None = None,
    ) -> RunContext:
        """What this layer's schedule runs with: its experts over its placement, the kept counts."""
        local = tuple(shard.expert for shard in self.placement.local(self.rank))
        return RunContext(
            self.experts, dtype, self.groups, self.placement, timing, workspace, filled_WE, local, capacity,
            self.config.expert_kernel, backend, estimate_E, prepared,
        )

    def _with_shared_experts(self, x_TM: torch.Tensor, y_TM: torch.Tensor) -> torch.Tensor:
        """Add the dense shared experts' output (Qwen2-MoE: times its sigmoid gate)."""
        return y_TM if self.shared_experts is None else y_TM + shared_output(x_TM, self.shared_experts,
                                                                             self.shared_expert_gate)

    # -- steps ---------------------------------------------------------------------------------

    def _backward_window(self, x: torch.Tensor, entering: bool) -> torch.Tensor:
        """Between the backward of the output (the combine) and of the input, this layer's
        all-to-alls are imminent: Lina's gradient scheduler holds its all-reduces meanwhile."""
        return x if self.world_size == 1 else mark_backward_window(x, self.groups.traffic, entering,
                                                                     self.groups.ledger, self.index)

    def _reduce_max(self) -> Callable[[Sequence[float]], list[float]]:
        """The slowest rank's times, for the planner (which imports no torch.distributed)."""
        groups = self.groups
        return lambda values: max_over_ranks(values, groups.expert, groups.ledger) if groups.expert else list(values)

    # -- state with all E experts ----------------------------------------------------------------

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a state dict that holds all E experts (a single-process run's, a checkpoint's, a
        converted Hugging Face model's), keeping this rank's part of the placement. The
        auxiliary-loss-free selection bias ``gate.expert_bias`` may be absent, as it is from a
        model that never had one: a strict load then sets it to zero, as in a new layer."""
        state = dict(state_dict)
        if strict and "gate.expert_bias" not in state:
            state["gate.expert_bias"] = torch.zeros_like(self.gate.expert_bias)
        self.load_state_dict(shard_expert_state(state, self.placement, self.rank), strict=strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The state with all E experts, on every rank: an explicit opt-in (tests, conversions, small
        models), since it holds every rank's experts at once; a collective over the expert group (each
        rank contributes its primary shards, one all-reduce per expert tensor)."""
        return gather_full_state(self.state_dict(), self.placement, self.rank, self.groups.expert)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"model_dim={c.model_dim}, hidden_dim={c.hidden_dim}, num_experts={c.num_experts} "
            f"({self.num_local_experts} local of {self.world_size} ranks, {self.schedule.name}), top_k={c.top_k}, "
            f"capacity_factor={c.capacity_factor}, gate={c.gate}, activation={c.activation}"
        )
