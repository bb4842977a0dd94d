"""MoELayer: the public entry point. Its forward reads as the data flow of DESIGN.md, one named
step after another:

route -> agree (the load, one all-gather, and the dispatcher) -> dispatch -> experts -> combine
-> shared experts -> record.

Shapes: T tokens on this rank, M model dim, E experts, L local experts (E / W under expert
parallelism, E when replicated), W ranks in the group, C capacity (slots per expert per rank), K top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moeflow.comm.groups import ParallelGroups, max_over_ranks
from moeflow.comm.traffic import mark_backward_window
from moeflow.config import TUTEL_POSITIONAL, MoEConfig, call_settings, config_from_arguments, resolve_normalize_gate
from moeflow.core.clamped_swiglu import clamp_of
from moeflow.core.experts import ExpertFFN, shared_output
from moeflow.core.routing import build_gate
from moeflow.core.routing.router import Routing, route
from moeflow.core.stats import RoutingStats
from moeflow.core.workspace import Workspace
from moeflow.kernels.choice import KernelChoice, KernelTable
from moeflow.kernels.precision import checked_tokens, compute_dtype
from moeflow.moe.bias_updates import BiasUpdates
from moeflow.moe.forward_memory import ForwardMemory, GraphValue, LastForward, recomputing
from moeflow.parallel.build import attach_mp_group, build_execution
from moeflow.parallel.dispatchers.capacity import CapacityDispatcher
from moeflow.parallel.dispatchers.choice import Agreed, Dispatchers
from moeflow.parallel.dispatchers.protocol import ForwardRecord, LayerCall, Stats
from moeflow.parallel.expert_parameters import mark_expert_parameters
from moeflow.parallel.moves import move_experts
from moeflow.parallel.online_planner import OnlinePlanner
from moeflow.parallel.placement import ExpertPlacement, gather_full_state, shard_expert_state
from moeflow.parallel.schedules import ParallelSchedule
from moeflow.perf import ClusterProfile, CostModel
from moeflow.sim.layer_ranking import SimulatedRanker


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
    algorithm, both planned per forward (:mod:`moeflow.parallel.online_planner`): ``"auto"`` ranks the candidates
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
    ``last_stats`` a :class:`~moeflow.core.stats.RoutingStats`.
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
        self._default_settings = call_settings(config, None, None, None, self.schedule.name, self.schedule.takes_r,
                                               self.world_size)  # a call that passes no k, factor or r: checked once
        self._replicas_equal = not self.placement.split_tokens  # replicas copy their primary before a forward
        self.planner = self._planner(self.schedule)
        c = config
        self.gate = build_gate(
            c.gate, c.model_dim, c.num_experts, c.cosine_projection_dim, c.cosine_min_temperature, c.gate_precision,
            c.gate_bias,
        )
        local = self.placement.local(self.rank)
        hidden_local = local[0].hidden_stop - local[0].hidden_start
        clamp = clamp_of(c)
        self.experts = ExpertFFN(len(local), c.model_dim, hidden_local, c.activation, c.expert_kernel, c.bias,
                                 initialize=False, clamp=clamp)
        # one draw from the global generator, whatever the placement: ranks seeded alike build the
        # experts one process would, each rank only its own (expert e from the seed and e)
        seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64, device="cpu"))
        self.experts.reset_by_expert(self.placement.local_slices(self.rank), seed, c.hidden_dim)
        mark_expert_parameters(self.experts)  # so that data parallelism leaves them alone
        shared_hidden = c.hidden_dim if c.shared_hidden_dim is None else c.shared_hidden_dim
        self.shared_experts = (
            ExpertFFN(c.num_shared_experts, c.model_dim, shared_hidden, c.activation, c.expert_kernel, c.bias,
                      clamp=clamp if c.swiglu_clamp_shared else None)
            if c.num_shared_experts
            else None
        )
        self.shared_expert_gate = nn.Linear(c.model_dim, 1, bias=False) if c.shared_expert_gate else None
        self.workspace = Workspace()  # the experts' large intermediates, reused step to step (see share_workspace)
        self.kernel_table = KernelTable()  # kernel_backend="auto"'s measured choices (see share_kernel_table)
        self._last = LastForward(GraphValue(torch.zeros(())))  # aux loss and statistics, for reading
        self.forward_memory = ForwardMemory()  # what activation checkpointing's recompute must repeat
        self._bias_updates = BiasUpdates()  # after each forward, or held over a step's micro-batches
        self.dispatchers = self._dispatchers()
        self.index: int | None = None  # its place in its model (the block number), named in hang reports

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (deepcopy, unpickling) marks its experts again: torch copies a Parameter bare."""
        super().__setstate__(state)
        mark_expert_parameters(self.experts)

    @property
    def aux_loss(self) -> torch.Tensor:
        """The last forward's weighted balance (+ z) loss, in its graph: add it to the loss."""
        return self._last.aux_loss.value

    def _dispatchers(self) -> Dispatchers:
        """The dispatchers of this layer's schedule, placement and planner (made again on ``switch()``)."""
        capacity = CapacityDispatcher(self.schedule, self.placement, self.groups, self.config, self.experts,
                                      self.planner)
        return Dispatchers.of(capacity)

    def _planner(self, schedule: ParallelSchedule) -> OnlinePlanner:
        """The per-iteration planner of ``schedule`` (degree and all-to-all) in the space it allows."""
        policy, algorithms, cost_model = schedule.plan_space(self.config.pipeline, self.algorithms, self.cost_model)
        reduce_max = self._reduce_max() if self.world_size > 1 else None
        return OnlinePlanner(
            policy, algorithms, cost_model, reduce_max, self.config.capacity_bucket, schedule=schedule.model,
            ranker=SimulatedRanker.from_profile,
        )

    @torch.no_grad()
    def switch(
        self, schedule: ParallelSchedule, placement: ExpertPlacement, optimizer: torch.optim.Optimizer | None = None,
        planner: OnlinePlanner | None = None,
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
        self.dispatchers = self._dispatchers()

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
        the router in fp32 (:mod:`moeflow.kernels.precision`)."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dtype = compute_dtype(x, self.experts.w1.dtype) if x.is_floating_point() else x.dtype
        device = x.device.type  # autocast off inside (the layer casts itself); entered only where it is on
        autocast_off = torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else nullcontext()
        with autocast_off, self.groups.ledger.at(layer=self.index, direction="forward"):
            return self._forward(x if x.dtype == dtype else x.to(dtype), top_k, capacity_factor, r)

    def _forward(
        self, x: torch.Tensor, top_k: int | None, capacity_factor: float | None, r: int | None
    ) -> torch.Tensor:
        call = self._call(x, top_k, capacity_factor, r)
        routing, estimate_E = self._route(call)
        agreed = self.dispatchers.agree(call, routing, estimate_E, self._last.gather_bucket)
        dispatch = agreed.dispatcher.dispatch(call, routing, agreed.load)
        expert_rows = self.experts.run_with_weights(dispatch.rows, dispatch.experts)  # FSDP2 gathers around it
        y_TM = dispatch.combine(expert_rows)
        stats = dispatch.stats()  # the dispatch's last step: what the call did (None for a recompute)
        y_TM = self._with_shared_experts(call.x_TM, y_TM)
        if not call.recompute:  # the balancing bias moves, the aux loss and statistics are this forward's
            self._after_forward(agreed, routing, stats)
        return self._backward_window(y_TM, entering=False).view(x.shape)

    def _call(self, x: torch.Tensor, top_k: int | None, capacity_factor: float | None, r: int | None) -> LayerCall:
        """The call's own values: its settings, its checked tokens, whether it is activation
        checkpointing's recompute (which repeats its forward and counts nothing twice) and its record."""
        config = self.config
        k, factor = self._settings(top_k, capacity_factor, r)
        x_TM = self._backward_window(checked_tokens(x, config.model_dim, config.check_finite), entering=True)
        self._ready()
        grad = torch.is_grad_enabled()  # a no-grad forward is never a recompute (that runs with grad) nor rerun
        recompute, moves_bias = grad and recomputing(), self._moves_bias
        kernels, workspace = self._kernels(x_TM), self._step_workspace(recompute)
        record = self.forward_memory.start(recompute, self.gate.expert_bias if moves_bias else None) if grad else (
            ForwardRecord())  # kept for no recompute: it would take a checkpointed forward's place
        return LayerCall(x_TM, k, factor, r, kernels, recompute, record, workspace, moves_bias, self.training)

    def _settings(self, top_k: int | None, capacity_factor: float | None, r: int | None) -> tuple[int, float]:
        """The call's k and capacity factor, checked (:func:`~moeflow.config.call_settings`); a call
        that passes none takes the config's, checked when the layer was built (a one-token forward is short)."""
        if top_k is None and capacity_factor is None and r is None:
            return self._default_settings
        return call_settings(self.config, top_k, capacity_factor, r, self.schedule.name, self.schedule.takes_r,
                             self.world_size)

    def _ready(self) -> None:
        """Refuse a data-parallel wrapper that would average the experts; replicas copy their primary."""
        self._last.checked_data_parallel = _refuse_averaging_data_parallel(
            self.experts, self.placement, self._last.checked_data_parallel)
        if not self._replicas_equal:
            self.switch(self.schedule, self.placement)

    def _kernels(self, x_TM: torch.Tensor) -> KernelChoice:
        return self.kernel_table.resolve(self.config.kernel_backend, x_TM.device, x_TM.dtype)

    @property
    def last_stats(self) -> RoutingStats | None:
        """The last forward's :class:`~moeflow.core.stats.RoutingStats` (a direct forward's on first read)."""
        if callable(self._last.stats):
            self._last.stats = self._last.stats()
        return self._last.stats

    def _after_forward(self, agreed: Agreed, routing: Routing, stats: Stats) -> None:
        """A forward (not a recompute) moves the loss-free balancing bias, keeps its aux loss, its
        statistics and the tokens the next load agreement carries."""
        self._last.aux_loss = GraphValue(routing.aux_loss)
        if self._moves_bias:
            rate = self.config.expert_bias_update_rate
            self._bias_updates.after_forward(self.gate, agreed.load.counts_WE.sum(0), rate)
        self._last.stats = stats
        if agreed.next_bucket is not None:
            self._last.gather_bucket = agreed.next_bucket

    def hold_bias_updates(self) -> None:
        """Loss-free balancing over several forwards that make one step (a pipeline's
        micro-batches): the selection bias stays as it is until :meth:`release_bias_updates`."""
        self._bias_updates.hold()

    def release_bias_updates(self, replicas: dist.ProcessGroup | None = None) -> None:
        """Move the selection bias once, from the load of every forward since :meth:`hold_bias_updates`
        and of every copy of this layer in ``replicas``: what one forward of the step's tokens would."""
        self._bias_updates.release(self.gate, self.config.expert_bias_update_rate, replicas)

    @property
    def _moves_bias(self) -> bool:
        """Whether a forward moves the selection bias after routing (loss-free balancing, training)."""
        return self.config.expert_bias_update_rate > 0 and self.training

    def _route(self, call: LayerCall) -> tuple[Routing, np.ndarray | None]:
        """This rank's routing (a recompute's with its forward's balancing bias) and, under Lina's
        inference scheduler (the schedule's hook), which sees the gate's choice, its estimate of the
        selections ahead (Lina's phase 1 for the next layer). The capacity
        slots are the capacity dispatcher's to assign (:meth:`Routing.slotted`)."""
        hook, x_TM, dropless = self.dispatchers.hook, call.x_TM, call.capacity_factor == 0
        with self.forward_memory.routing_bias(call.record, self.gate.expert_bias) if call.recompute else nullcontext():
            observe = None if hook is None else functools.partial(hook.routed, num_experts=self.config.num_experts,
                                                                  rank=self.rank)
            routing = route(self.gate, x_TM, call.top_k, self.config, self.node_limit, observe, slots=False,
                            dropless=dropless)
            estimate_E = None if hook is None else hook.estimate(x_TM.shape[0])
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
        model that never had one, and so may SwiGLU's up bias ``b3``, as it is from a layer saved
        before it existed: a strict load then sets them to zero, which computes what those did."""
        state = dict(state_dict)
        if strict:
            for name, zeros in self._absent_means_zero().items():
                state.setdefault(name, zeros)
        self.load_state_dict(shard_expert_state(state, self.placement, self.rank), strict=strict)

    def _absent_means_zero(self) -> dict[str, torch.Tensor]:
        """The full-state entries a strict load fills with zeros where a state dict lacks them."""
        zeros = {"gate.expert_bias": torch.zeros_like(self.gate.expert_bias)}
        if self.experts.b3 is not None:
            zeros["experts.b3"] = self.experts.b3.new_zeros(self.config.num_experts, self.config.hidden_dim)
        if self.shared_experts is not None and self.shared_experts.b3 is not None:
            zeros["shared_experts.b3"] = torch.zeros_like(self.shared_experts.b3)
        return zeros

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


def _refuse_averaging_data_parallel(experts: nn.Module, placement: ExpertPlacement, checked: int | None) -> int | None:
    """Raise when the forward runs inside a plain ``DistributedDataParallel`` that reduces these
    experts: it broadcast rank 0's experts over the others' when it was built and would average
    every expert's gradient with other ranks' different experts. Replicated experts are ordinary
    replicated weights, which it may average. Returns the id of the DDP module checked, which a
    later call passes as ``checked`` to skip it (the check then costs one attribute read)."""
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)  # torch's, for torch.compile
    ddp = active() if active is not None else None
    if ddp is None or id(ddp) == checked or placement.is_replicated:
        return checked
    reduced = {id(p) for p in getattr(ddp, "_module_parameters", ddp.module.parameters())}
    if any(id(p) in reduced for p in experts.parameters()):
        raise RuntimeError(
            "a moeflow MoELayer runs inside a DistributedDataParallel that treats its experts as replicated "
            "weights: DDP copied rank 0's experts over every other rank's when it was built and averages each "
            "expert's gradient with other ranks' different experts, so the model would train E/W distinct experts. "
            "Wrap the model with moeflow.training.data_parallel.expert_data_parallel(model) instead (DDP for the other "
            "weights, on a process group of its own, each expert reduced over its own copies)."
        )
    return id(ddp)
