"""Parm's schedules S1 and S2 and the DeepSpeed-MoE baseline they replace, as expert regions of
the simulator (Parm §III-B, §IV; ``plan.mp`` = N_MP, ``plan.esp`` = N_ESP).

MP groups and ESP groups are consecutive ranks inside a node (Parm's Case 2); the EP group of the
baseline is the ranks equal modulo N_ESP. ``buffer`` is one rank's dispatched buffer, E x C x M
(Parm's ETM). Per layer and direction (the backward repeats the forward's collectives: under
Megatron's convention each all-gather's backward is a free split and each split's an all-gather):

- ``ds-baseline`` (Eq. 1): ESP all-gather of the tokens, EP all-to-all of N_ESP x buffer, every
  expert shard on N_ESP x the tokens, ESP all-reduce of the partials, EP all-to-all back; every MP
  member repeats all of it.
- ``s1`` (PauseMP before the gate): the gate, the all-to-alls and the experts see 1 / N_MP of the
  tokens; Parm's fused EP&ESP all-to-all over all ranks (dump, then one exchange of
  N_ESP x buffer / N_MP, or with ``plan.packed_s1`` of N_ESP x the member's occupied slots, as
  moeflow's S1 sends no empty slot); the MP all-gather restores the tokens after the decode.
- ``s2`` (PauseMP after the gate): every member gates all tokens, exchanges its 1 / N_MP of the
  buffer, and the combine's all-to-all runs beside the MP all-gather of the buffer (SAA) in the
  forward; the backward runs them one after the other.

Each pipelines its exchange, experts and exchange back over ``plan.degree`` capacity chunks, as
moeflow's Parm schedules do (chunk i's experts overlap chunk i + 1's dispatch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moeflow.perf.pipeline import capacity_chunks
from moeflow.perf.sim.cluster import Cluster
from moeflow.perf.sim.engine import ALLTOALL, COMPUTE, MODEL_PARALLEL
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.technique import PlanSpace, SimulatedSchedule
from moeflow.perf.sim.workload import ModelSpec

if TYPE_CHECKING:
    from moeflow.perf.sim.builder import StepBuilder
    from moeflow.perf.sim.workload import LayerLoad



def _experts(b: StepBuilder, buffer: float, deps: list[int], backward: bool, slowdown: float = 1.0) -> int:
    """Each rank's expert shards (hidden / N_ESP) on the ``buffer`` bytes of slots it received."""
    m, esp = b.model, b.plan.esp
    rows = buffer / (m.dims.model_dim * m.element_bytes)
    local = max(1, m.dims.num_experts * esp // b.cluster.world_size)
    seconds = slowdown * b.ffn_s(rows, backward, local_experts=local, shards=esp)
    return b.timeline.compute(COMPUTE, seconds, deps, "experts")


def _pipelined(b: StepBuilder, slots: int, whole: float, deps: list[int], backward: bool,
               exchange: Callable[[float, list[int]], int],
               after_experts: Callable[[float, list[int]], int] | None = None) -> tuple[int, list[int]]:
    """``whole`` bytes of ``slots`` capacity slots in the plan's chunks; chunk i: ``exchange`` of
    its share, the experts on it, (``after_experts``,) ``exchange`` back; dispatches D1..Dd first,
    as the executor issues them. Returns the last experts' operation and the returns."""
    shares = [(stop - start) / slots for start, stop in capacity_chunks(slots, b.plan.degree)] or [1.0]
    slowdown = b.device.overlap_slowdown if len(shares) > 1 else 1.0
    sent = [exchange(whole * share, deps) for share in shares]
    computed = [_experts(b, whole * share, [d], backward, slowdown) for share, d in zip(shares, sent, strict=True)]
    done = [after_experts(whole * share, [c]) if after_experts else c
            for share, c in zip(shares, computed, strict=True)]
    return computed[-1], [exchange(whole * share, [d]) for share, d in zip(shares, done, strict=True)]


def _copy(b: StepBuilder, nbytes: float, deps: list[int], category: str) -> int:
    return b.timeline.compute(COMPUTE, b.memory_s(2 * nbytes), deps, category)


def _fused_alltoall(b: StepBuilder, sent: float, deps: list[int]) -> int:
    """Parm's EP&ESP all-to-all: ``sent`` bytes per rank spread evenly over every rank."""
    return b.alltoall(sent / b.cluster.world_size, deps)


def _mp_allgather(b: StepBuilder, whole: float, deps: list[int], stream: str = ALLTOALL) -> int:
    steps = b.network.allgather(whole / b.plan.mp, b.plan.mp)
    return b.collective(stream, steps, deps, "allgather-mp", b.priority)


def _member_slots(b: StepBuilder, load: LayerLoad, packed: bool) -> int:
    """Capacity slots per expert one MP member sends: its 1 / N_MP of the padded capacity (Parm's
    S1 and S2), or packed, its own tokens' occupied slots (moeflow's S1: no empty slot travels)."""
    capacity, mp = b.capacity(load), b.plan.mp
    occupied = min(capacity, math.ceil(float(load.counts.max(initial=0.0)))) if packed else capacity
    return max(1, -(-occupied // mp))


def _paused_mp_exchange(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool,
                        packed: bool) -> tuple[int, list[int]]:
    """What S1 and S2 share: dump, the fused all-to-all of this member's slots to the N_ESP shards
    of their experts, the expert shards, the fused all-to-all back (pipelined) and the local sum
    of the shards' partials. Returns the last experts' operation and what follows the sum."""
    m, esp = b.model, b.plan.esp
    slots = _member_slots(b, load, packed)
    sent = float(m.dims.num_experts * slots * m.dims.model_dim * m.element_bytes * esp)
    dumped = [_copy(b, sent, deps, "dump")] if esp > 1 else deps
    computed, returned = _pipelined(b, slots, sent, dumped, backward,
                                    lambda nbytes, d: _fused_alltoall(b, nbytes, d))
    return computed, [_copy(b, sent, returned, "combine-sum")] if esp > 1 else returned


def s1_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    _, summed = _paused_mp_exchange(b, load, deps, backward, packed=b.plan.packed_s1)
    return [_mp_allgather(b, b.token_bytes, summed)]


def s2_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    computed, summed = _paused_mp_exchange(b, load, deps, backward, packed=False)
    buffer = b.buffer_bytes(load)
    if backward:
        return [_mp_allgather(b, buffer, summed)]
    return [*summed, _mp_allgather(b, buffer, [computed], MODEL_PARALLEL)]  # SAA: beside the combine


def baseline_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    esp, network = b.plan.esp, b.network
    gathered = b.buffer_bytes(load) * esp
    inputs = b.collective(ALLTOALL, network.allgather(b.token_bytes, esp), deps, "allgather-esp", b.priority)
    peers = b.cluster.world_size // esp

    def exchange(nbytes: float, after: list[int]) -> int:
        return b.collective(ALLTOALL, network.strided_alltoall(nbytes / peers, esp), after, "alltoall", b.priority)

    def reduce(nbytes: float, after: list[int]) -> int:
        return b.collective(ALLTOALL, network.allreduce(nbytes, group=esp), after, "allreduce-esp", b.priority)

    return _pipelined(b, b.capacity(load), gathered, [inputs], backward, exchange, reduce)[1]


def check_parm_layout(cluster: Cluster, model: ModelSpec, plan: StepPlan) -> None:
    """MP and ESP groups are consecutive ranks inside one node, and the EP groups share the experts."""
    for name in ("mp", "esp"):
        size = getattr(plan, name)
        if cluster.gpus_per_node % size:
            raise ValueError(f"{name} ({size}) must divide the {cluster.gpus_per_node} GPUs per node: "
                             f"its groups are consecutive ranks inside a node")
    peers = cluster.world_size // plan.esp
    if model.dims.num_experts % peers:
        raise ValueError(f"{model.dims.num_experts} experts do not divide over the {peers} EP ranks (world / esp); "
                         "use a multiple of that many experts or another esp")


def _plans(esps: Callable[[int], tuple[int, ...]]) -> Callable[[str, PlanSpace], list[StepPlan]]:
    """At every pipeline degree behind the space's MP group, for each N_ESP ``esps(mp)`` gives,
    where the experts divide over the EP ranks (world / esp)."""
    def plans(name: str, space: PlanSpace) -> list[StepPlan]:
        world, num_experts = space.cluster.world_size, space.model.dims.num_experts
        return [StepPlan(name, degree, mp=space.mp, esp=esp, prioritize_alltoall=space.prioritize_alltoall)
                for esp in esps(space.mp) for degree in space.degrees if num_experts % (world // esp) == 0]
    return plans


WHOLE_OR_SHARDED = _plans(lambda mp: (1, mp))  # experts whole, or sharded over the MP group (moeflow's layout)
def _settings(combine: str, esp: bool = True) -> Callable[[StepPlan], dict[str, Any]]:
    """A Parm plan's ``moeflow train`` settings: its schedule and degree behind ``mp_size``, the
    combine's all-to-all, and N_ESP where the schedule takes one."""
    def settings(plan: StepPlan) -> dict[str, Any]:
        return {"parallel": plan.schedule, "pipeline": plan.degree, "alltoall": combine, "mp_size": plan.mp,
                **({"esp_size": plan.esp} if esp else {})}
    return settings


S1 = SimulatedSchedule(s1_region, WHOLE_OR_SHARDED, check_parm_layout, gated_share=lambda plan: 1.0 / plan.mp,
                       settings=_settings("linear"))
S2 = SimulatedSchedule(s2_region, WHOLE_OR_SHARDED, check_parm_layout, settings=_settings("saa"))  # S2 with SAA
BASELINE = SimulatedSchedule(baseline_region, _plans(lambda mp: (mp,)), check_parm_layout,
                             gated_share=lambda plan: float(plan.esp), settings=_settings("linear", esp=False))
"""DeepSpeed-MoE's layout: every expert sharded over the ESP group (= the MP group), the experts
divided over the EP ranks."""
