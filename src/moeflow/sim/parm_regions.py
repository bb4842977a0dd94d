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
  N_ESP x buffer / N_MP); the MP all-gather restores the tokens after the decode.
- ``s2`` (PauseMP after the gate): every member gates all tokens, exchanges its 1 / N_MP of the
  buffer, and the combine's all-to-all runs beside the MP all-gather of the buffer (SAA) in the
  forward; the backward runs them one after the other.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from moeflow.sim.engine import ALLTOALL, COMPUTE, MODEL_PARALLEL

if TYPE_CHECKING:
    from moeflow.sim.step import StepBuilder
    from moeflow.sim.workload import LayerLoad

PARM_SCHEDULES = ("s1", "s2", "ds-baseline")


def gated_share(schedule: str, mp: int, esp: int) -> float:
    """Tokens each rank gates (and encodes and decodes), as a share of its MP group's tokens."""
    return {"s1": 1.0 / mp, "ds-baseline": float(esp)}.get(schedule, 1.0)


def _experts(b: StepBuilder, buffer: float, deps: list[int], backward: bool) -> int:
    """Each rank's expert shards (hidden / N_ESP) on the ``buffer`` bytes of slots it received."""
    m, esp = b.model, b.plan.esp
    rows = buffer / (m.model_dim * m.element_bytes)
    local = max(1, m.experts * esp // b.cluster.world_size)
    return b.timeline.compute(COMPUTE, b.ffn_s(rows, backward, local_experts=local, shards=esp), deps, "experts")


def _copy(b: StepBuilder, nbytes: float, deps: list[int], category: str) -> int:
    return b.timeline.compute(COMPUTE, b.memory_s(2 * nbytes), deps, category)


def _fused_alltoall(b: StepBuilder, sent: float, deps: list[int]) -> int:
    """Parm's EP&ESP all-to-all: ``sent`` bytes per rank spread evenly over every rank."""
    return b.alltoall(sent / b.cluster.world_size, deps)


def _mp_allgather(b: StepBuilder, whole: float, deps: list[int], stream: str = ALLTOALL) -> int:
    steps = b.network.allgather(whole / b.plan.mp, b.plan.mp)
    return b.collective(stream, steps, deps, "allgather-mp", b.priority)


def _paused_mp_exchange(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> tuple[int, int]:
    """What S1 and S2 share: dump, the fused all-to-all of this member's N_ESP x buffer / N_MP,
    the expert shards, the fused all-to-all back and the local sum of the shards' partials.
    Returns the experts' and the sum's operations."""
    esp = b.plan.esp
    sent = b.buffer_bytes(load) * esp / b.plan.mp
    dumped = _copy(b, sent, deps, "dump") if esp > 1 else deps[0]
    computed = _experts(b, sent, [_fused_alltoall(b, sent, [dumped])], backward)
    returned = _fused_alltoall(b, sent, [computed])
    return computed, _copy(b, sent, [returned], "combine-sum") if esp > 1 else returned


def s1_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    _, summed = _paused_mp_exchange(b, load, deps, backward)
    return [_mp_allgather(b, b.token_bytes, [summed])]


def s2_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    computed, summed = _paused_mp_exchange(b, load, deps, backward)
    buffer = b.buffer_bytes(load)
    if backward:
        return [_mp_allgather(b, buffer, [summed])]
    return [summed, _mp_allgather(b, buffer, [computed], MODEL_PARALLEL)]  # SAA: beside the combine


def baseline_region(b: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    esp, network = b.plan.esp, b.network
    gathered = b.buffer_bytes(load) * esp
    inputs = b.collective(ALLTOALL, network.allgather(b.token_bytes, esp), deps, "allgather-esp", b.priority)
    peers = b.cluster.world_size // esp
    exchange = network.strided_alltoall(gathered / peers, esp)
    dispatched = b.collective(ALLTOALL, exchange, [inputs], "alltoall", b.priority)
    computed = _experts(b, gathered, [dispatched], backward)
    reduced = b.collective(ALLTOALL, network.allreduce(gathered, group=esp), [computed], "allreduce-esp",
                           b.priority)
    return [b.collective(ALLTOALL, exchange, [reduced], "alltoall", b.priority)]


PARM_REGIONS = MappingProxyType({"s1": s1_region, "s2": s2_region, "ds-baseline": baseline_region})
