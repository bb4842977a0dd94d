"""The joint planner: every (pipeline stages, expert group size, schedule, pipeline degree, all-to-all
algorithm, shadowing) the cluster can run, ranked by the simulator. The layout is the pipeline size P
(stages over P groups of world / P consecutive ranks, run by a pipeline schedule over M
micro-batches), the expert-parallel group size EP inside a stage (experts over EP consecutive
ranks, copied over the stage's data-parallel replicas) and, behind ``mp``, the tensor-parallel
attention group. Plans are ranked on a few-layer proxy of the model (layers add up, except where the
gradient all-reduce overlaps the layers below) and the best are re-simulated at full depth; a
pipeline's stage plans are ranked once per P and its schedules and micro-batch counts priced for
the best few, so a 2,048-rank search takes seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moeflow.config import EXACT_WIRE, GRADIENT_BUCKET_MB
from moeflow.parallel.registry import FEATURE_SPECS, SIMULATED
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.plan import StepPlan, schedule_pairs, schedule_stages
from moeflow.perf.sim.technique import PlanSpace
from moeflow.perf.sim.workload import LayerLoad, ModelSpec, routing_loads
from moeflow.progress import Progress, Quiet
from moeflow.sim.pipelined import data_rank_sequences, data_rank_tokens, pipeline_sizes, stage_plan
from moeflow.sim.step import WIRE_FEATURE, StepResult, sends_wire, simulate_step

DEGREES = (1, 2, 4, 8)
"""The pipeline degrees the plan search tries."""
SHADOWED = (0, 1, 2, 4)
"""The numbers of shadowed experts the plan search tries."""
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "dualpipev")
"""The pipeline schedules the search tries. ``gpipe`` and ``zbv`` are priced (``moeflow simulate
--pp-schedule``) but not searched: GPipe takes 1F1B's time, ``(M + P - 1)(F + B)`` less what the
sends shift, while holding all M micro-batches' activations (1F1B at most P); ZBV's split backward
measured the slowest of the five on moeflow's CPU runs (docs/benchmarks/2026-11-30-pipeline-schedules.md:
it keeps the graph alive between its input and weight halves), a cost the model does not price."""
MICROBATCH_MULTIPLES = (1, 2, 4)
"""The micro-batch counts the search tries, as multiples of the schedule's stage count."""
PIPELINE_FINALISTS = 3
"""Stage plans per pipeline size whose schedules and micro-batch counts are priced at full depth."""


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose from."""

    degrees: tuple[int, ...] = DEGREES
    shadowed: tuple[int, ...] = SHADOWED
    prioritize_alltoall: bool = False
    mp: int = 1  # > 1: attention is tensor-parallel over this many ranks, so Parm's schedules run
    ep_sizes: tuple[int, ...] = ()  # the expert group sizes to try; (): every size that tiles the nodes
    wire_dtype: str = EXACT_WIRE  # the run's wire format: plans whose exchange carries it are priced in it
    pp_sizes: tuple[int, ...] = ()  # the pipeline sizes to try; (): 1 and every size that fits; (1,): no pipeline


def algorithms_for(cluster: Cluster) -> list[str]:
    """2DH needs several nodes of several ranks and pairwise several nodes to differ from linear."""
    out = ["linear"]
    if cluster.nodes > 1 and cluster.gpus_per_node > 1:
        out.append("2dh")
    if cluster.nodes > 1:
        out.append("pairwise")
    return out


def expert_group_sizes(cluster: Cluster) -> list[int]:
    """The expert-parallel group sizes the layout search tries: every size that tiles the nodes
    (divides a node, or spans whole ones), largest first (every rank: plain expert parallelism)."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    return sorted((ep for ep in range(1, world + 1) if world % ep == 0 and (per_node % ep == 0 or ep % per_node == 0)),
                  reverse=True)


def candidate_plans(cluster: Cluster, model: ModelSpec, space: SearchSpace = SearchSpace()) -> list[StepPlan]:
    """Every plan the search simulates for ``model`` on ``cluster``: at each pipeline size
    (:func:`pipeline_choices`), for each expert group size (:func:`expert_group_sizes` of the
    cluster, or of one stage's ranks, or ``space.ep_sizes``), each simulated technique's own plans
    (its record's) on one group's ranks, behind tensor-parallel attention when ``space.mp`` > 1 and
    beside it otherwise, at the pipeline degrees, all-to-all algorithms and shadowed experts in
    ``space``; a pipelined stage's plans at each schedule and micro-batch count
    (:func:`pipelined_variants`). Schedules that hold every expert on every rank run over the
    world (or the stage) only."""
    if space.mp > 1 and cluster.gpus_per_node % space.mp:
        raise ValueError(f"--mp {space.mp} must divide the {cluster.gpus_per_node} GPUs per node "
                         "(MP groups stay in a node)")
    plans = []
    for pp in pipeline_choices(cluster, model, space):
        found = _layout_plans(cluster, model, space) if pp == 1 else _pipelined_plans(cluster, model, space, pp)
        if not found and pp > 1 and space.pp_sizes:
            raise ValueError(f"pp {pp}: no stage plan fits: a schedule's stages (P or 2P) must be at most the "
                             f"{model.layers} layers, its micro-batches (1, 2 or 4 times the stages) must divide the "
                             f"{data_rank_sequences(model, pp)} sequences of a data rank (the global batch's over "
                             f"world / pp ranks), and "
                             "the experts must divide over a stage's expert group: change --pp-size, the layers or "
                             "the sequences per rank (--batch-size)")
        plans += found
    if space.wire_dtype != EXACT_WIRE:  # the run sends its rows so: only the schedules that carry it remain
        plans = [replace(plan, wire_dtype=space.wire_dtype) for plan in plans if sends_wire(plan.schedule)]
        if not plans:
            carriers = ", ".join(FEATURE_SPECS[WIRE_FEATURE].runs_on)
            raise ValueError(f"wire_dtype={space.wire_dtype!r} is sent by {carriers} only, and none of them runs "
                             f"here (mp {space.mp}): use wire_dtype='exact'")
    return sorted(plans, key=lambda plan: plan.esp)  # behind MP: whole experts first, then sharded


def _layout_plans(cluster: Cluster, model: ModelSpec, space: SearchSpace, place: str = "cluster") -> list[StepPlan]:
    """Each expert group size's plans on ``cluster`` (the world, or one pipeline stage's ranks)."""
    tiling = expert_group_sizes(cluster)
    sizes = space.ep_sizes or tiling
    bad = [ep for ep in sizes if ep not in tiling]
    if bad:
        raise ValueError(f"ep sizes {bad} do not tile the {cluster.nodes} x {cluster.gpus_per_node} {place}; "
                         f"use some of {tiling}")
    plans = []
    for ep in sizes:
        if space.mp > 1 and ep % space.mp:
            continue  # an MP group lies inside one expert group
        group = cluster.expert_group(ep)
        plans += [plan if ep == cluster.world_size else replace(plan, ep=ep)
                  for plan in _group_plans(group, model, space, whole_world=ep == cluster.world_size)]
    return plans


def pipeline_choices(cluster: Cluster, model: ModelSpec, space: SearchSpace) -> list[int]:
    """The pipeline sizes to search: ``space.pp_sizes``, or 1 and every size whose stages tile the
    nodes (:func:`~moeflow.sim.pipelined.pipeline_sizes`) and whose stage count fits the layers;
    none above 1 behind ``mp`` or with Lina's gradient sync, which the pipelined trainer does not run."""
    runs_pipelines = space.mp == 1 and not space.prioritize_alltoall
    if not space.pp_sizes:
        return [pp for pp in pipeline_sizes(cluster) if pp == 1 or (runs_pipelines and pp <= model.layers)]
    tiling = pipeline_sizes(cluster)
    bad = [pp for pp in space.pp_sizes if pp not in tiling]
    if bad:
        raise ValueError(f"pp sizes {bad} do not split the {cluster.nodes} x {cluster.gpus_per_node} cluster into "
                         f"stages of consecutive ranks that tile the nodes; use some of {tiling}")
    deep = [pp for pp in space.pp_sizes if pp > model.layers]
    if deep:
        raise ValueError(f"pp sizes {deep} make more stages than the model's {model.layers} layers: use a smaller "
                         "--pp-size or more layers")
    if max(space.pp_sizes) > 1 and not runs_pipelines:
        raise ValueError("the pipelined trainer runs neither tensor-parallel attention (--mp) nor Lina's gradient "
                         "sync (--prioritize-alltoall): drop them, or --pp-size")
    return list(space.pp_sizes)


def _pipelined_plans(cluster: Cluster, model: ModelSpec, space: SearchSpace, pp: int) -> list[StepPlan]:
    """A stage's plans that the pipelined trainer runs (whole experts or none shadowed, no slots),
    each at every schedule and micro-batch count that fits; expert group sizes that do not tile a
    stage are skipped unless the pipeline size was asked for."""
    stage = cluster.expert_group(cluster.world_size // pp)
    sizes = tuple(ep for ep in space.ep_sizes if ep in expert_group_sizes(stage))
    if space.ep_sizes and not sizes and not space.pp_sizes:
        return []
    inner = _layout_plans(stage, model, replace(space, shadowed=(0,), ep_sizes=sizes or space.ep_sizes),
                          f"stage of pp {pp}")
    return [variant for plan in inner if not plan.redundant_slots
            for variant in pipelined_variants(plan, pp, model, plan.ep or stage.world_size)]


def pipelined_variants(plan: StepPlan, pp: int, model: ModelSpec, group: int) -> list[StepPlan]:
    """``plan`` as one stage of ``pp`` under each searched schedule (:data:`PIPELINE_SCHEDULES`)
    whose stages fit the layers, at 1, 2 and 4 times its stage count of micro-batches where they
    divide a data rank's sequences (:func:`~moeflow.sim.pipelined.data_rank_sequences`: the same
    global batch); DualPipeV's pairs overlapped where the stage has an expert group (``group`` > 1
    ranks: ``moeflow train``'s default)."""
    sequences, variants = data_rank_sequences(model, pp), []
    for schedule in PIPELINE_SCHEDULES:
        stages = schedule_stages(schedule, pp)
        if stages > model.layers:
            continue
        overlap = schedule_pairs(schedule) and group > 1
        variants += [replace(plan, pp=pp, pp_schedule=schedule, microbatches=stages * k, pp_overlap=overlap,
                             bucket_mb=math.inf)
                     for k in MICROBATCH_MULTIPLES if sequences >= stages * k and sequences % (stages * k) == 0]
    return variants


def _group_plans(group: Cluster, model: ModelSpec, space: SearchSpace, whole_world: bool) -> list[StepPlan]:
    """Each technique's plans on one expert group's ranks."""
    world, num_experts = group.world_size, model.dims.num_experts
    shadows = tuple(s for s in space.shadowed if s < num_experts) if world > 1 else (0,)
    degrees = space.degrees if world > 1 else (1,)  # nothing travels: nothing to pipeline
    plan_space = PlanSpace(group, model, degrees, tuple(algorithms_for(group)), shadows,
                           space.prioritize_alltoall, space.mp)
    behind = space.mp > 1
    plans = [plan for name, spec in SIMULATED.items()
             if spec.behind_model_parallel == behind and (whole_world or not spec.replicates_experts)
             for plan in spec.simulated.plans(name, plan_space)]
    return plans if world > 1 else plans[:1]  # on one rank every schedule runs alike: its experts at home


def search(cluster: Cluster, model: ModelSpec, training: bool = True, top: int = 5, proxy_layers: int = 2,
           space: SearchSpace = SearchSpace(), progress: Progress | None = None) -> list[StepResult]:
    """The ``top`` plans, fastest first, simulated at the model's full depth. Inference plans no
    pipeline (a pipelined plan is a training step's). ``progress`` counts the simulations: a large
    cluster's search takes minutes."""
    if not training and max(space.pp_sizes, default=1) > 1:
        raise ValueError("a pipelined plan (--pp-size > 1) is a training step's: drop --forward-only or --pp-size")
    space = space if training else replace(space, pp_sizes=(1,))
    candidates = candidate_plans(cluster, model, space)
    if not candidates:
        layout = f"{cluster.nodes} x {cluster.gpus_per_node}"
        raise ValueError(f"no plan fits {model.dims.num_experts} experts on the {layout} cluster with mp {space.mp} "
                         f"and expert group sizes {list(space.ep_sizes) or 'any'}: an expert group holds whole MP "
                         "groups and its experts must divide over it (change --ep-size, --mp or the experts)")
    loads, progress = _Loads(model), progress or Quiet()
    flat = [plan for plan in candidates if plan.pp == 1]
    results = _unpipelined(cluster, model, flat, training, top, proxy_layers, loads, progress) if flat else []
    for pp in sorted({plan.pp for plan in candidates} - {1}):
        results += _pipelined(cluster, model, [plan for plan in candidates if plan.pp == pp], proxy_layers, loads,
                              progress)
    return sorted(results, key=lambda result: result.step_s)[:top]


def _unpipelined(cluster: Cluster, model: ModelSpec, candidates: list[StepPlan], training: bool, top: int,
                 proxy_layers: int, loads: _Loads, progress: Progress) -> list[StepResult]:
    """The best unpipelined plans of the proxy, at full depth under each gradient sync."""
    proxy = model.with_overrides(layers=min(proxy_layers, model.layers))
    proxy_loads = _Loads(proxy)

    def proxy_time(plan: StepPlan) -> float:
        step_s = simulate_step(cluster, proxy, plan, training, proxy_loads.of(cluster, plan)).step_s
        progress.advance()
        return step_s

    progress.expect(len(candidates))
    ranked = sorted(candidates, key=proxy_time)
    finalists = [variant for plan in ranked[:max(top, 1) * 2] for variant in gradient_sync_variants(plan, training)]
    return _full_depth(cluster, model, finalists, training, loads, progress)


def _pipelined(cluster: Cluster, model: ModelSpec, candidates: list[StepPlan], proxy_layers: int,
               loads: _Loads, progress: Progress) -> list[StepResult]:
    """One pipeline size's plans: its stage plans ranked once, unpipelined on a stage's ranks over a
    proxy of the fewest micro-batches' tokens; the schedules and micro-batch counts of the best
    :data:`PIPELINE_FINALISTS` at full depth."""
    pp = candidates[0].pp
    stage = cluster.expert_group(cluster.world_size // pp)
    tokens = data_rank_tokens(model, pp) // min(plan.pipeline_microbatches for plan in candidates)
    proxy = model.with_overrides(layers=min(proxy_layers, model.layers), tokens_per_rank=tokens,
                                 sequence_length=min(model.sequence_length, tokens))
    proxy_loads = _Loads(proxy)

    def proxy_time(plan: StepPlan) -> float:
        step_s = simulate_step(stage, proxy, plan, True, proxy_loads.of(stage, plan)).step_s
        progress.advance()
        return step_s

    stage_plans = list(dict.fromkeys(stage_plan(plan) for plan in candidates))
    progress.expect(len(stage_plans))
    best = sorted(stage_plans, key=proxy_time)[:PIPELINE_FINALISTS]
    return _full_depth(cluster, model, [plan for plan in candidates if stage_plan(plan) in best], True, loads,
                       progress)


def _full_depth(cluster: Cluster, model: ModelSpec, plans: list[StepPlan], training: bool, loads: _Loads,
                progress: Progress) -> list[StepResult]:
    """The finalists simulated at the model's full depth, each counted as it ends."""
    progress.expect(len(plans))
    results = []
    for plan in plans:
        results.append(simulate_step(cluster, model, plan, training, loads.of(cluster, plan)))
        progress.advance()
    return results


def gradient_sync_variants(plan: StepPlan, training: bool = True) -> list[StepPlan]:
    """``plan`` under each way ``moeflow train`` all-reduces the gradients (``grad_sync``): after the
    backward, or in DDP's buckets during it; a plan that prioritizes the all-to-all is Lina's own."""
    if plan.prioritize_alltoall or not training:
        return [plan]
    return [replace(plan, bucket_mb=math.inf), replace(plan, bucket_mb=GRADIENT_BUCKET_MB)]


@dataclass
class _Loads:
    """One model's routing loads per expert group size, drawn once."""

    model: ModelSpec
    drawn: dict[int, list[LayerLoad]] = field(default_factory=dict)

    def of(self, cluster: Cluster, plan: StepPlan) -> list[LayerLoad]:
        """The loads of ``plan``'s expert group: ``ep`` ranks, or the cluster's (a pipeline stage's)."""
        ranks = plan.ep or cluster.world_size // plan.pp
        if ranks not in self.drawn:
            self.drawn[ranks] = routing_loads(self.model, ranks)
        return self.drawn[ranks]
