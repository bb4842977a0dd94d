"""Layer-vs-reference equivalence, run inside each gloo worker (or a plain single process).

Every case builds a :class:`ReferenceMoE` from a seed on every rank (so all ranks hold the same full
weights), loads this rank's shard into a :class:`MoELayer`, runs forward and backward on this rank's
own tokens in both, and compares outputs, the aux loss, the gradients of x, of the gate and of every
expert weight (the reference's expert gradients summed over ranks, since each expert sees the tokens
of every rank) and the global routing counts.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.config import switchable_rs
from moeflow.parallel.placement import shard_expert_state
from moeflow.parallel.registry import MODEL_PARALLEL_SCHEDULES
from moeflow.perf import AlphaBeta, ClusterProfile
from moeflow.perf.kernel_rates import KernelRates
from moeflow.reference import ReferenceMoE
from moeflow.training.packing import pack_layer
from moeflow.training.rebalance import rebalance_layer

# fp32: the layer sums in a different order than the reference (bmm vs per-expert mm, index_add
# over slots): a few ulps of the O(1) values and O(T) weight-gradient sums used here.
FP32_TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}
# float64: same math, so differences are pure rounding of order 1e-15 (fp32 gate logits aside,
# which both sides compute identically).
FP64_TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}
# bf16 keeps 8 significant bits (eps = 2^-7). Both sides round every op's result to bf16, at
# different points (bmm vs per-expert mm, fp32 vs bf16 accumulation, index_add order), so each
# differs from the exact value by a few eps relative to its operands: 4 eps covers the O(1) values
# and the short (12-24 term) sums here, and a wrong slot, weight or gradient is off by O(1).
BF16_EPS = torch.finfo(torch.bfloat16).eps
BF16_TOLERANCE = {"rtol": 4 * BF16_EPS, "atol": 4 * BF16_EPS}
# fp32 on a GPU (TF32 off, torch's default for matmuls): other kernels' summation orders, as in test_gpu.py
GPU_FP32_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
TOLERANCES = {torch.float64: FP64_TOLERANCE, torch.float32: FP32_TOLERANCE, torch.bfloat16: BF16_TOLERANCE}


PLANTED_RATES = {  # expert_kernel="auto" decided by these rates, not by a probe (its ragged_below: 2, 0, 0.5)
    "auto-ragged": KernelRates(1.0, 0.0, 0.5), "auto-bmm": KernelRates(1.0, 1.0, 1.0),
    "auto-half": KernelRates(1.0, 0.0, 2.0),
}


PROFILE_FAVOURING_2DH = ClusterProfile(
    nodes=2, ranks_per_node=2,
    fits={"alltoall.linear": AlphaBeta(2e-3, 1e-8), "alltoall.2dh": AlphaBeta(1e-3, 1e-8),
          "alltoall.pairwise": AlphaBeta(3e-3, 1e-8), "gemm": AlphaBeta(1e-5, 1e-11)},
)


# parameters far cheaper to move than tokens: Algorithm 1 shadows the hot expert
PROFILE_CHEAP_SHADOWS = ClusterProfile(
    nodes=2, ranks_per_node=2,
    fits={"alltoall.linear": AlphaBeta(1e-4, 1e-6), "allreduce": AlphaBeta(1e-6, 1e-12), "gemm": AlphaBeta(1e-6, 1e-9)},
)
PROFILE_DEAR_PARAMETERS = ClusterProfile(  # moving an expert's weights costs more than any token exchange
    nodes=2, ranks_per_node=2,
    fits={"alltoall.linear": AlphaBeta(1e-4, 1e-8), "allreduce": AlphaBeta(1e-3, 1e-6), "gemm": AlphaBeta(1e-6, 1e-9)},
)


@dataclass(frozen=True)
class Case:
    name: str
    layer: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)
    num_experts: int = 8
    tokens_per_rank: int = 12
    model_dim: int = 8
    hidden_dim: int = 12
    dtype: torch.dtype = torch.float32
    steps: int = 1
    same_expert: bool = False
    expert_bias_std: float = 0.0  # a fixed selection bias (DeepSeek-V3's e_score_correction_bias)
    empty_ranks: tuple[int, ...] = ()  # ranks (mod world size) that get no tokens
    ranks_per_node: int | None = None  # ranks per node of the topology for the topology-aware all-to-alls
    expected_alltoall: str | None = None  # the algorithm the layer must report using (multi-rank)
    r_per_step: tuple[str, ...] = ()  # Tutel's r of each step's call ("r0", "r1", "rmid", "rmax")
    mp: int = 1  # tensor-parallel group size (Parm): tokens replicated over consecutive ranks
    rebalance_to: tuple[float, ...] = ()  # redundant experts: before step 1, rebalance for this load
    rebalance_later: tuple[tuple[float, ...], ...] = ()  # ... and before steps 2, 3, ... for these
    pack_factor: int = 0  # Lina's packing: before step 1, hold this many times E / W experts per rank
    tolerance: dict[str, float] | None = None  # a wire format's stated bound instead of the dtype's


def mp_size(case: Case, world_size: int) -> int:
    """The case's MP size on this world (1 where the world is smaller: the case then runs as EP)."""
    return case.mp if world_size % case.mp == 0 and torch.distributed.is_initialized() else 1


def grid_cases() -> list[Case]:
    """The full grid of the issue: k x capacity factor x gate x activation x BPR."""
    cases = []
    for k, factor, gate, activation, bpr in itertools.product(
        (1, 2, 3), (1.0, 0.0, -1.5, 0.5), ("softmax", "cosine"), ("relu", "gelu", "silu", "swiglu"),
        (False, True),
    ):
        layer = {
            "top_k": k, "capacity_factor": factor, "gate": gate, "activation": activation,
            "batch_prioritized_routing": bpr, "cosine_projection_dim": 6,
        }
        cases.append(Case(f"k{k}-f{factor}-{gate}-{activation}-bpr{int(bpr)}", layer))
    return cases


CLAMPED_SWIGLU = {"activation": "swiglu", "swiglu_limit": 0.5, "swiglu_alpha": 1.702, "swiglu_up_offset": 1.0}


def extra_cases() -> list[Case]:
    base = {"top_k": 2, "capacity_factor": 1.0}
    return [
        Case("empty-all", base, tokens_per_rank=0),
        Case("empty-f0", {**base, "capacity_factor": 0.0}, tokens_per_rank=0),
        Case("empty-rank0", base, empty_ranks=(0,)),
        Case("empty-rank0-f0", {**base, "capacity_factor": 0.0}, empty_ranks=(0,)),
        Case("same-expert-f1", base, same_expert=True),
        Case("same-expert-f0", {**base, "capacity_factor": 0.0}, same_expert=True),
        Case("same-expert-bpr", {**base, "batch_prioritized_routing": True}, same_expert=True),
        Case("dynamic-topk-call", base, call={"top_k": 3, "capacity_factor": 0.0}),
        Case("dynamic-f-call", base, call={"capacity_factor": 0.25}),
        Case("one-local-expert", base, num_experts=4),
        Case("many-tokens", {**base, "capacity_factor": 0.5}, tokens_per_rank=96),
        Case("3d-input-shape", base, tokens_per_rank=12),
        Case("sigmoid", {**base, "score_function": "sigmoid"}),
        Case("sigmoid-unnormalized", {**base, "score_function": "sigmoid", "normalize_gate": False}),
        Case("unnormalized", {**base, "normalize_gate": False}),
        Case("z-loss", {**base, "z_loss_weight": 1e-3, "aux_loss_weight": 0.1}),
        Case("no-aux", {**base, "aux_loss_weight": 0.0}),
        Case("shared-experts", {**base, "num_shared_experts": 2}),
        Case("shared-swiglu", {**base, "num_shared_experts": 1, "activation": "swiglu"}),
        Case("qwen2-gated-shared-expert", {**base, "num_shared_experts": 1, "shared_hidden_dim": 20,
                                           "shared_expert_gate": True, "activation": "swiglu", "bias": False}),
        Case(
            "bias-balancing", {**base, "expert_bias_update_rate": 0.05, "score_function": "sigmoid"},
            steps=3,
        ),
        Case("bias-balancing-softmax", {**base, "expert_bias_update_rate": 0.05}, steps=3),
        Case("deepseek-groups-scaled", {**base, "score_function": "sigmoid", "expert_groups": 4, "top_groups": 2,
                                        "routed_scaling_factor": 2.5, "activation": "swiglu", "bias": False,
                                        "num_shared_experts": 1}),
        Case("deepseek-v3-router-fixed-bias", {**base, "score_function": "sigmoid", "expert_groups": 4,
                                               "top_groups": 2, "routed_scaling_factor": 2.5}, expert_bias_std=0.3),
        Case("deepseek-groups-bias-balancing-f0", {**base, "score_function": "sigmoid", "expert_groups": 2,
                                                   "top_groups": 1, "routed_scaling_factor": 0.5,
                                                   "capacity_factor": 0.0, "expert_bias_update_rate": 0.05}, steps=3),
        Case("loop-kernel", {**base, "expert_kernel": "loop"}),
        Case("loop-kernel-swiglu", {**base, "expert_kernel": "loop", "activation": "swiglu"}),
        # the ragged kernel: only the filled slots are computed (one GEMM per expert that has rows)
        Case("ragged-f0-swiglu-nobias", {**base, "expert_kernel": "ragged", "capacity_factor": 0.0,
                                         "activation": "swiglu", "bias": False}),
        Case("ragged-f1-drops-gelu-bias", {**base, "expert_kernel": "ragged", "top_k": 3}),
        Case("ragged-d2-bpr", {**base, "expert_kernel": "ragged", "pipeline": 2, "batch_prioritized_routing": True,
                               "capacity_factor": 2.0}, tokens_per_rank=24),
        Case("ragged-empty-rank", {**base, "expert_kernel": "ragged", "capacity_factor": 0.0}, empty_ranks=(1,)),
        # expert_kernel="auto" with planted rates: always ragged (one process: the kept rows), never, and
        # ragged under half the slots filled (calls and ranks then differ in their kernel)
        Case("auto-kernel-ragged-f0-swiglu", {**base, "expert_kernel": "auto-ragged", "capacity_factor": 0.0,
                                              "activation": "swiglu"}),
        Case("auto-kernel-bmm-f1", {**base, "expert_kernel": "auto-bmm", "top_k": 3}),
        Case("auto-kernel-half-f2-empty-rank", {**base, "expert_kernel": "auto-half", "capacity_factor": 2.0},
             empty_ranks=(1,), steps=2),
        Case("ragged-replicated", {**base, "expert_kernel": "ragged", "parallel": "replicated",
                                   "activation": "swiglu"}),
        # gpt-oss's clamped SwiGLU (a low cap, so that many values are capped) on each kernel and path
        Case("clamped-swiglu-bmm-drops-bias", {**base, **CLAMPED_SWIGLU}),
        Case("clamped-swiglu-loop-shared", {**base, **CLAMPED_SWIGLU, "expert_kernel": "loop",
                                            "num_shared_experts": 1}),
        Case("clamped-swiglu-clamped-shared", {**base, **CLAMPED_SWIGLU, "num_shared_experts": 1,
                                               "swiglu_clamp_shared": True, "bias": False}),
        Case("clamped-swiglu-ragged-d2-f0", {**base, **CLAMPED_SWIGLU, "expert_kernel": "ragged", "bias": False,
                                             "capacity_factor": 0.0, "pipeline": 2}, tokens_per_rank=24),
        Case("clamped-swiglu-ragged-replicated", {**base, **CLAMPED_SWIGLU, "expert_kernel": "ragged",
                                                  "parallel": "replicated"}),
        # gpt-oss's experts (clamped SwiGLU, biases on every projection) and router (a logit bias)
        Case("gpt-oss-like-ragged-f0", {**base, **CLAMPED_SWIGLU, "gate_bias": True, "expert_kernel": "ragged",
                                        "capacity_factor": 0.0, "gate_precision": "input"}),
        Case("gate-bias-sigmoid-drops", {**base, "gate_bias": True, "score_function": "sigmoid"}),
        # FasterMoE's shadowing: the shadowed experts run on every rank's own tokens
        Case("shadow-hot-expert-f0", {**base, "shadowing": [0], "capacity_factor": 0.0}, same_expert=True),
        Case("shadow-two-ragged-swiglu", {**base, "shadowing": [0, 5], "expert_kernel": "ragged",
                                          "activation": "swiglu", "bias": False, "capacity_factor": 0.0}),
        Case("shadow-d2-drops", {**base, "shadowing": [1], "pipeline": 2}, tokens_per_rank=24),
        Case("shadow-empty-rank-2dh", {**base, "shadowing": [2, 3], "alltoall": "2dh"}, empty_ranks=(1,),
             ranks_per_node=2),
        Case("shadow-auto", {**base, "shadowing": "auto", "profile": PROFILE_CHEAP_SHADOWS, "capacity_factor": 0.0},
             same_expert=True),
        Case("shadow-all-experts", {**base, "shadowing": list(range(8)), "capacity_factor": 0.0}),
        # EPLB's redundant experts: 12 slots (3, 6 or 12 per rank), a rebalance between two steps
        Case("redundant-hot-expert-f0", {**base, "redundant_experts": 4, "capacity_factor": 0.0}, same_expert=True,
             steps=2, rebalance_to=(90.0, 1, 1, 1, 1, 1, 1, 1)),
        Case("redundant-ragged-swiglu-empty-rank", {**base, "redundant_experts": 4, "expert_kernel": "ragged",
                                                    "activation": "swiglu", "bias": False, "capacity_factor": 0.0},
             empty_ranks=(1,), steps=2, rebalance_to=(5.0, 30, 1, 1, 9, 1, 1, 0)),
        Case("redundant-d2-drops-bpr", {**base, "redundant_experts": 4, "pipeline": 2,
                                        "batch_prioritized_routing": True}, tokens_per_rank=24, steps=2,
             rebalance_to=(1.0, 1, 1, 1, 1, 1, 20, 20)),
        Case("redundant-2dh-k1", {**base, "redundant_experts": 8, "alltoall": "2dh", "top_k": 1}, ranks_per_node=2,
             same_expert=True),
        Case("redundant-smart", {**base, "redundant_experts": 4, "pipeline": "smart"}, ranks_per_node=1,
             same_expert=True, steps=2, rebalance_to=(50.0, 40, 1, 1, 1, 1, 1, 1)),
        # balance='auto': off until the first rebalance, then the cost model's choice for each load
        # (on the cheap profile, 2 and 4 ranks: the slots, shadowing, then the slots on 2 ranks, off on 4)
        Case("balance-auto-switches", {**base, "redundant_experts": 4, "balance": "auto", "capacity_factor": 0.0,
                                       "profile": PROFILE_CHEAP_SHADOWS}, same_expert=True, steps=4,
             rebalance_to=(90.0, 1, 1, 1, 1, 1, 1, 1), rebalance_later=((60.0, 30, 0, 0, 0, 0, 0, 0), (24.0,) * 8)),
        Case("balance-auto-stays-off-ragged", {**base, "redundant_experts": 4, "balance": "auto",
                                               "expert_kernel": "ragged", "capacity_factor": 0.0,
                                               "profile": PROFILE_DEAR_PARAMETERS}, steps=2,
             rebalance_to=(5.0, 30, 1, 1, 9, 1, 1, 0)),
        # Lina's expert packing: expert parallel for step 0, then blocks of W / factor ranks holding
        # every expert (4 ranks x2: blocks of 2; 2 ranks x2 and 4 ranks x4: every expert on every rank)
        Case("packed-x2", {**base, "parallel": "expert"}, steps=2, pack_factor=2),
        Case("packed-x2-d2-drops-swiglu", {**base, "parallel": "expert", "pipeline": 2, "activation": "swiglu"},
             tokens_per_rank=24, steps=2, pack_factor=2),
        Case("packed-x2-ragged-f0-empty-rank", {**base, "parallel": "expert", "expert_kernel": "ragged",
                                                 "capacity_factor": 0.0}, empty_ranks=(1,), steps=2, pack_factor=2),
        Case("packed-x4-bpr", {**base, "parallel": "expert", "batch_prioritized_routing": True}, steps=2,
             pack_factor=4),
        # FasterMoE's smart schedule: pairwise steps (one per node), each step's experts overlapping the next
        Case("smart-k2-f1", {**base, "pipeline": "smart"}, ranks_per_node=1, tokens_per_rank=16),
        Case("smart-2-per-node-swiglu", {**base, "pipeline": "smart", "activation": "swiglu"}, ranks_per_node=2),
        Case("smart-ragged-f0-empty-rank", {**base, "pipeline": "smart", "expert_kernel": "ragged",
                                            "capacity_factor": 0.0}, ranks_per_node=1, empty_ranks=(1,)),
        Case("smart-shadow-hot-expert", {**base, "pipeline": "smart", "shadowing": [0], "capacity_factor": 0.0},
             ranks_per_node=1, same_expert=True),
        Case("smart-3-steps-bpr", {**base, "pipeline": "smart", "batch_prioritized_routing": True, "top_k": 1},
             ranks_per_node=1, steps=3),
        # FasterMoE's topology-aware gate: the reference applies the same rule to its rank's tokens
        Case("topology-gate-quarter-f0", {**base, "topology_gate": 0.25, "capacity_factor": 0.0}, ranks_per_node=1,
             tokens_per_rank=16),
        Case("topology-gate-none-leave-d2", {**base, "topology_gate": 0.0, "pipeline": 2}, ranks_per_node=1,
             tokens_per_rank=24),
        Case("topology-gate-2-per-node-shadow", {**base, "topology_gate": 0.1, "shadowing": [1],
                                                 "capacity_factor": 0.0}, ranks_per_node=2, tokens_per_rank=20),
        Case("topology-gate-k1-bpr-ragged", {**base, "topology_gate": 0.5, "top_k": 1, "expert_kernel": "ragged",
                                             "batch_prioritized_routing": True}, ranks_per_node=1),
        # the ragged token exchange: only the kept rows cross the links, each algorithm, pipelined
        *ragged_exchange_cases(base),
        # the Triton kernels (under TRITON_INTERPRET=1 on CPU): fused encode/decode, ragged grouped GEMMs
        Case("triton-k8-f1-drops", {**base, "kernel_backend": "triton", "top_k": 8}),
        Case("triton-k8-ragged-f0-swiglu", {**base, "kernel_backend": "triton", "expert_kernel": "ragged", "top_k": 8,
                                             "capacity_factor": 0.0, "activation": "swiglu", "bias": False}),
        Case("triton-ragged-zero-token-experts", {**base, "kernel_backend": "triton", "expert_kernel": "ragged",
                                                  "capacity_factor": 0.0}, same_expert=True, empty_ranks=(1,)),
        Case("triton-ragged-d2-bias-bpr", {**base, "kernel_backend": "triton", "expert_kernel": "ragged",
                                           "pipeline": 2, "batch_prioritized_routing": True}, tokens_per_rank=24),
        Case("triton-ragged-smart-shadow", {**base, "kernel_backend": "triton", "expert_kernel": "ragged",
                                            "pipeline": "smart", "shadowing": [0], "capacity_factor": 0.0},
             ranks_per_node=1, same_expert=True),
        Case("triton-ragged-redundant", {**base, "kernel_backend": "triton", "expert_kernel": "ragged",
                                         "redundant_experts": 4, "capacity_factor": 0.0, "top_k": 3}, steps=2,
             rebalance_to=(20.0, 1, 1, 1, 1, 1, 1, 9)),
        Case("ragged-float64-loop", {**base, "expert_kernel": "ragged", "capacity_factor": 0.0,
                                     "activation": "silu"}, dtype=torch.float64),
        *[
            Case(
                f"alltoall-{algorithm}-{per_node}-per-node",
                {**base, "alltoall": algorithm, "capacity_factor": factor},
                ranks_per_node=per_node,
                empty_ranks=empty,
            )
            for algorithm in ("2dh", "pairwise")
            for per_node, factor, empty in ((2, 1.0, ()), (1, 0.0, (1,)), (4, 0.5, ()))
        ],
        Case(
            "alltoall-auto-from-profile", {**base, "alltoall": "auto", "profile": PROFILE_FAVOURING_2DH},
            ranks_per_node=2, expected_alltoall="2dh",
        ),
        Case("alltoall-auto-without-profile", {**base, "alltoall": "auto"}, expected_alltoall="linear"),
        *pipeline_cases(base),
        *parallel_cases(base),
        *adaptive_cases(base),
        *parm_cases(base),
        Case("float64", {**base, "capacity_factor": 0.5, "gate": "cosine"}, dtype=torch.float64),
        Case("float64-mixtral-router-input-precision", {**base, "gate_precision": "input", "activation": "swiglu",
                                                        "bias": False, "capacity_factor": 0.0}, dtype=torch.float64),
        Case("float64-swiglu-bpr", {**base, "activation": "swiglu", "batch_prioritized_routing": True},
             dtype=torch.float64),
    ]


def parallel_cases(base: dict[str, Any]) -> list[Case]:
    """The replicated schedule and bias-free experts (Mixtral-style), alone and with the other
    paths: capacity factors, swiglu, pipelining, shared experts, k = 1 with Tutel's gate rule."""
    replicated = {**base, "parallel": "replicated"}
    return [
        Case("replicated", replicated),
        Case("replicated-f0-swiglu", {**replicated, "capacity_factor": 0.0, "activation": "swiglu"}),
        Case("replicated-k1-bpr", {**replicated, "top_k": 1, "batch_prioritized_routing": True}),
        Case("replicated-d3", {**replicated, "pipeline": 3}, tokens_per_rank=24),
        Case("replicated-empty-rank0", replicated, empty_ranks=(0,)),
        Case("replicated-six-experts", replicated, num_experts=6),
        Case("replicated-no-bias-cosine", {**replicated, "bias": False, "gate": "cosine", "cosine_projection_dim": 6}),
        Case("no-bias", {**base, "bias": False}),
        Case("no-bias-swiglu-f0", {**base, "bias": False, "activation": "swiglu", "capacity_factor": 0.0}),
        Case("no-bias-shared", {**base, "bias": False, "num_shared_experts": 1}),
        Case("no-bias-d4-pairwise", {**base, "bias": False, "pipeline": 4, "alltoall": "pairwise"},
             tokens_per_rank=48, ranks_per_node=2),
        Case("no-bias-loop-kernel", {**base, "bias": False, "expert_kernel": "loop"}),
        Case("k1-tutel-normalization", {**base, "top_k": 1}),
        Case("k1-no-bias-d2", {**base, "top_k": 1, "bias": False, "pipeline": 2}, tokens_per_rank=24),
        Case("float64-replicated-d2", {**replicated, "pipeline": 2, "activation": "swiglu"}, dtype=torch.float64),
    ]


def adaptive_cases(base: dict[str, Any]) -> list[Case]:
    """Tutel's r on its one storage layout: E = 8 (W <= E: r in {0, 1}), E = 2 and E = 1 (hidden
    sharded over W / E ranks on 4 workers); "rmax" is ceil(W / E), "rmid" the middle valid r.
    Capacity factors 1, 0, -1.5, top-1/2, degrees 1, 3 and 4 (chunks padded to the gather group),
    algorithms, SwiGLU without biases, the planner searching r, and r switched on every call."""
    def adaptive(r: str, **extra: Any) -> dict[str, Any]:
        return {**base, "parallel": r, **extra}

    return [
        Case("adaptive-r0", adaptive("r0")),
        Case("adaptive-r1", adaptive("r1")),
        Case("adaptive-E2-rmax", adaptive("rmax"), num_experts=2),
        Case("adaptive-E2-r0-f0", adaptive("r0", capacity_factor=0.0), num_experts=2),
        Case("adaptive-E2-r1-d4", adaptive("r1", pipeline=4), num_experts=2, tokens_per_rank=48),
        Case("adaptive-E2-rmax-d4-f-1.5", adaptive("rmax", pipeline=4, capacity_factor=-1.5), num_experts=2,
             tokens_per_rank=40),
        Case("adaptive-E1-rmid-k1", adaptive("rmid", top_k=1), num_experts=1),
        Case("adaptive-E1-rmax-k1-d3-uneven", adaptive("rmax", top_k=1, pipeline=3, capacity_factor=-1.5),
             num_experts=1, tokens_per_rank=20),
        Case("adaptive-E1-r0-k1", adaptive("r0", top_k=1), num_experts=1),
        Case("adaptive-E2-r1-swiglu-no-bias", adaptive("r1", activation="swiglu", bias=False), num_experts=2),
        Case("adaptive-E2-rmax-clamped-swiglu-bias", adaptive("rmax", **CLAMPED_SWIGLU), num_experts=2),
        Case("adaptive-E2-rmax-pairwise", adaptive("rmax", alltoall="pairwise", top_k=1), num_experts=2,
             ranks_per_node=2),
        Case("adaptive-E2-search", adaptive("adaptive", pipeline="search", alltoall="auto"), num_experts=2,
             tokens_per_rank=32, ranks_per_node=2, steps=8),
        Case("adaptive-E1-r-switched-every-call", adaptive("adaptive", top_k=1), num_experts=1, steps=4,
             r_per_step=("r0", "rmax", "r1", "rmid")),
        Case("adaptive-E2-float64-rmax-d2", adaptive("rmax", pipeline=2), num_experts=2, tokens_per_rank=24,
             dtype=torch.float64),
    ]


def parm_cases(base: dict[str, Any]) -> list[Case]:
    """Parm's S2 and the DeepSpeed-MoE baseline behind MP = 2 (MP 2 x EP 2 on 4 workers, MP 2 x EP 1
    on 2): E = 2 and E = 8 (four experts per EP group), capacity factors 1, 0 and -1.5, top-1/2,
    degrees 1, 3 and 4 (chunks padded to the MP group), SwiGLU without biases."""
    s2 = {**base, "parallel": "s2"}
    s1 = {**base, "parallel": "s1"}
    return [
        Case("parm-s2-E2", s2, num_experts=2, mp=2),
        Case("parm-s2-E8-f0", {**s2, "capacity_factor": 0.0}, mp=2),
        Case("parm-s2-E2-k1-f-1.5-d4", {**s2, "top_k": 1, "capacity_factor": -1.5, "pipeline": 4}, num_experts=2,
             tokens_per_rank=30, mp=2),
        Case("parm-s2-E8-d3-swiglu-no-bias", {**s2, "pipeline": 3, "activation": "swiglu", "bias": False},
             tokens_per_rank=24, mp=2),
        Case("parm-s2-E8-clamped-swiglu-bias", {**s2, **CLAMPED_SWIGLU}, mp=2),
        Case("parm-s1-E8-esp2-clamped-swiglu-bias", {**s1, **CLAMPED_SWIGLU, "esp_size": 2}, mp=2),
        Case("parm-s2-E2-float64", s2, num_experts=2, mp=2, dtype=torch.float64),
        Case("parm-s2-saa-E8-d3", {**s2, "alltoall": "saa", "pipeline": 3}, tokens_per_rank=24, mp=2),
        Case("parm-s2-saa-E2-k1-f-1.5", {**s2, "alltoall": "saa", "top_k": 1, "capacity_factor": -1.5},
             num_experts=2, tokens_per_rank=30, mp=2),
        Case("parm-s1-E2", s1, num_experts=2, mp=2),
        Case("parm-s1-E8-f1-drops", {**s1, "capacity_factor": 0.5}, mp=2),
        Case("parm-s1-E8-f0", {**s1, "capacity_factor": 0.0}, mp=2),
        Case("parm-s1-E2-k1-f-1.5-d4", {**s1, "top_k": 1, "capacity_factor": -1.5, "pipeline": 4}, num_experts=2,
             tokens_per_rank=31, mp=2),
        Case("parm-s1-E8-d3-swiglu-no-bias-bpr", {**s1, "pipeline": 3, "activation": "swiglu", "bias": False,
                                                  "batch_prioritized_routing": True}, tokens_per_rank=25, mp=2),
        Case("parm-s1-E2-float64", s1, num_experts=2, mp=2, dtype=torch.float64),
        Case("parm-auto-E8-switches", {**base, "parallel": "auto", "pipeline": 1}, mp=2, steps=11),
        *parm_layout_cases(s1, s2),
        Case("parm-baseline-E2", {**base, "parallel": "ds-baseline"}, num_experts=2, mp=2),
        Case("parm-baseline-E8-k1-f-1.5-d4", {**base, "parallel": "ds-baseline", "top_k": 1, "capacity_factor": -1.5,
                                             "pipeline": 4}, tokens_per_rank=30, mp=2),
        Case("parm-baseline-E8-f0-swiglu-no-bias", {**base, "parallel": "ds-baseline", "capacity_factor": 0.0,
                                                   "activation": "swiglu", "bias": False}, mp=2),
    ]


def parm_layout_cases(s1: dict[str, Any], s2: dict[str, Any]) -> list[Case]:
    """Parm's Table III layouts on 4 workers: N_MP and N_ESP in {1, 2, 4} independently (N_MP > 1),
    S1, S2 and S2 with SAA (whose MP all-gathers pair up across EP groups where N_MP > N_ESP). On
    fewer workers a layout that does not fit runs with N_ESP = N_MP, or as plain EP."""
    saa = {**s2, "alltoall": "saa"}
    cases = []
    for mp, esp in ((2, 1), (2, 4), (4, 1), (4, 2), (4, 4)):
        for name, layer in (("s1", s1), ("s2", s2), ("s2-saa", saa)):
            cases.append(Case(f"parm-{name}-mp{mp}-esp{esp}", {**layer, "esp_size": esp, "pipeline": 2},
                              tokens_per_rank=16, mp=mp))
    cases.append(Case("parm-auto-mp2-esp4-switches", {**s1, "parallel": "auto", "esp_size": 4, "pipeline": 1},
                      mp=2, steps=11))
    return cases


def resolve_r(name: str, num_experts: int, world_size: int) -> int:
    """A case's symbolic r on this many workers."""
    rs = switchable_rs(num_experts, world_size)
    return {"r0": 0, "r1": 1, "rmax": rs[-1], "rmid": rs[len(rs) // 2]}[name]


def ragged_exchange_cases(base: dict[str, Any]) -> list[Case]:
    """The ragged token exchange: dropless and dropping, each algorithm and pipelined (uneven
    chunks), with the ragged kernel, an empty rank or no token at all, and under FasterMoE's
    shadows and EPLB's slots (which hand it their own counts)."""
    ragged = {**base, "token_exchange": "ragged", "parallel": "expert"}
    return [
        Case("exchange-ragged-f0", {**ragged, "capacity_factor": 0.0}),
        Case("exchange-ragged-f05-drops-k3", {**ragged, "capacity_factor": 0.5, "top_k": 3}, tokens_per_rank=24),
        Case("exchange-ragged-d3-f0-swiglu-ragged-kernel", {**ragged, "pipeline": 3, "capacity_factor": 0.0,
                                                            "activation": "swiglu", "expert_kernel": "ragged"},
             tokens_per_rank=30),
        Case("exchange-ragged-2dh-d2", {**ragged, "pipeline": 2, "alltoall": "2dh"}, tokens_per_rank=24,
             ranks_per_node=2),
        Case("exchange-ragged-pairwise-empty-rank", {**ragged, "alltoall": "pairwise", "capacity_factor": 0.0},
             ranks_per_node=1, empty_ranks=(1,)),
        Case("exchange-ragged-no-tokens", {**ragged, "capacity_factor": 0.0}, tokens_per_rank=0),
        Case("exchange-ragged-same-expert-d2", {**ragged, "pipeline": 2}, same_expert=True),
        Case("exchange-ragged-shadow", {**ragged, "shadowing": [0], "capacity_factor": 0.0}, same_expert=True),
        Case("exchange-ragged-redundant", {**ragged, "redundant_experts": 4, "capacity_factor": 0.0}, steps=2,
             rebalance_to=(9.0, 1, 1, 1, 1, 1, 1, 3)),
        Case("exchange-auto-search", {**base, "token_exchange": "auto", "pipeline": "search", "parallel": "expert"},
             tokens_per_rank=24, steps=5),
        *dedup_exchange_cases(base),
    ]


def dedup_exchange_cases(base: dict[str, Any]) -> list[Case]:
    """The dedup exchange (a token once to each rank; under 2DH once to each node): k = 3 over 8
    experts (most tokens reach a rank twice), dropping and pipelined in uneven chunks with the ragged
    kernel, each algorithm, an empty rank, no token at all, and a wire format."""
    dedup = {**base, "token_exchange": "dedup", "parallel": "expert"}
    return [
        Case("exchange-dedup-f0-k3", {**dedup, "capacity_factor": 0.0, "top_k": 3}),
        Case("exchange-dedup-f05-drops-d3-swiglu-ragged-kernel", {
            **dedup, "capacity_factor": 0.5, "top_k": 3, "pipeline": 3, "activation": "swiglu",
            "expert_kernel": "ragged"}, tokens_per_rank=30),
        Case("exchange-dedup-2dh-d2", {**dedup, "pipeline": 2, "alltoall": "2dh", "top_k": 2}, tokens_per_rank=24,
             ranks_per_node=2),  # on 4 processes: a token once to each node (moeflow.parallel.node_dedup)
        Case("exchange-dedup-2dh-k4-f0-empty-rank", {**dedup, "alltoall": "2dh", "top_k": 4, "capacity_factor": 0.0},
             ranks_per_node=2, empty_ranks=(1,)),
        Case("exchange-dedup-pairwise-empty-rank", {**dedup, "alltoall": "pairwise", "capacity_factor": 0.0},
             ranks_per_node=1, empty_ranks=(1,)),
        Case("exchange-dedup-no-tokens", {**dedup, "capacity_factor": 0.0}, tokens_per_rank=0),
        Case("exchange-dedup-bf16-wire-k4", {**dedup, "top_k": 4, "wire_dtype": "bf16"},
             tolerance=WIRE_TOLERANCE["bf16"]),
    ]


def pipeline_cases(base: dict[str, Any]) -> list[Case]:
    """Pipeline degrees x all-to-all algorithms (d=8 really makes 8 chunks: capacity 12), plus the
    planner policies; uneven chunks (capacity 5 and f=0), swiglu, k=1 and an empty rank."""
    cases = [
        Case(f"pipeline-d{degree}-{algorithm}", {**base, "pipeline": degree, "alltoall": algorithm},
             tokens_per_rank=48, ranks_per_node=2)
        for degree in (2, 4, 8) for algorithm in ("linear", "2dh", "pairwise")
    ]
    return [
        *cases,
        Case("pipeline-d3-uneven-chunks", {**base, "pipeline": 3}, tokens_per_rank=20),
        Case("pipeline-d4-f0-swiglu", {**base, "pipeline": 4, "capacity_factor": 0.0, "activation": "swiglu"},
             tokens_per_rank=30),
        Case("pipeline-d4-k1-empty-rank", {**base, "pipeline": 4, "top_k": 1}, tokens_per_rank=40,
             empty_ranks=(1,)),
        Case("pipeline-d2-loop-kernel", {**base, "pipeline": 2, "expert_kernel": "loop"}, tokens_per_rank=24),
        Case("pipeline-d8-shared-experts", {**base, "pipeline": 8, "num_shared_experts": 1}, tokens_per_rank=48),
        Case("pipeline-search-5-steps", {**base, "pipeline": "search", "alltoall": "auto"}, tokens_per_rank=48,
             ranks_per_node=2, steps=5),
        Case("pipeline-model", {**base, "pipeline": "model", "alltoall": "auto", "profile": PROFILE_FAVOURING_2DH},
             tokens_per_rank=48, ranks_per_node=2, expected_alltoall="2dh"),
        Case("pipeline-d4-float64", {**base, "pipeline": 4, "gate": "cosine"}, tokens_per_rank=32,
             dtype=torch.float64),
    ]


def bf16_cases() -> list[Case]:
    """The equivalence table's shapes in bf16: each activation, k, dropping and dropless, the
    pipelined, ragged, Triton, shared-expert and topology-aware paths."""
    base = {"top_k": 2, "capacity_factor": 1.0}
    cases = [
        Case(f"bf16-k{k}-f{factor}-{gate}-{activation}", {"top_k": k, "capacity_factor": factor, "gate": gate,
                                                          "activation": activation, "cosine_projection_dim": 6},
             dtype=torch.bfloat16)
        for k, factor, gate, activation in (
            (1, 1.0, "softmax", "relu"), (2, 0.0, "softmax", "gelu"), (3, 0.5, "cosine", "silu"),
            (2, 1.0, "softmax", "swiglu"), (8, -1.5, "softmax", "gelu"),
        )
    ]
    return [*cases, *(Case(f"bf16-{name}", {**base, **layer}, dtype=torch.bfloat16, **extra) for name, layer, extra in (
        ("d2-drops-bpr", {"pipeline": 2, "batch_prioritized_routing": True}, {"tokens_per_rank": 24}),
        ("ragged-f0-swiglu", {"expert_kernel": "ragged", "capacity_factor": 0.0, "activation": "swiglu",
                              "bias": False}, {"empty_ranks": (1,)}),
        ("triton-k8-ragged-f0", {"kernel_backend": "triton", "expert_kernel": "ragged", "top_k": 8,
                                 "capacity_factor": 0.0}, {}),
        ("shared-gated-swiglu", {"num_shared_experts": 1, "shared_expert_gate": True, "activation": "swiglu"}, {}),
        ("smart-shadow", {"pipeline": "smart", "shadowing": [0], "capacity_factor": 0.0},
         {"ranks_per_node": 1, "same_expert": True}),
        ("redundant-f0", {"redundant_experts": 4, "capacity_factor": 0.0}, {"steps": 2,
                                                                          "rebalance_to": (9.0, 1, 1, 1, 1, 1, 1, 3)}),
        ("exchange-ragged-d2-f0", {"token_exchange": "ragged", "pipeline": 2, "capacity_factor": 0.0}, {}),
    ))]


# A wire format rounds every exchanged row (tokens, expert outputs, their gradients) once each way:
# bf16 to 2^-8 of each value, fp8 (e4m3, a scale per row) to 2^-4. Through the experts' two GEMMs and
# the gradients' sums of 12-48 such products the layer's values (O(1) here) stay within 8 of those
# roundings (measured: at most 0.12 for bf16, 0.30 for fp8); bf16 rows off by 5 % or fp8 scales off
# by 30 % fail every case. That each path sends the format at all is test_wire's bytes test.
WIRE_TOLERANCE = {"bf16": {"rtol": 8 * 2**-8, "atol": 8 * 2**-8}, "fp8": {"rtol": 8 * 2**-4, "atol": 8 * 2**-4}}


def wire_cases(base: dict[str, Any]) -> list[Case]:
    """The wire formats (``wire_dtype``) on each exchange that carries them: padded and ragged,
    pipelined, each algorithm, FasterMoE's smart steps, EPLB's slots, Tutel's switchable r, and fp8
    on a bf16 model, within the format's bound."""
    def wire(name: str, wire_dtype: str, layer: dict[str, Any], **extra: Any) -> Case:
        return Case(f"wire-{wire_dtype}-{name}", {**base, "wire_dtype": wire_dtype, **layer},
                    tolerance=WIRE_TOLERANCE[wire_dtype], **extra)

    return [
        wire("padded", "bf16", {"token_exchange": "padded"}),
        wire("ragged-f0-d2-swiglu", "bf16", {"token_exchange": "ragged", "capacity_factor": 0.0, "pipeline": 2,
                                            "activation": "swiglu", "bias": False}, tokens_per_rank=24),
        wire("2dh-d2", "bf16", {"alltoall": "2dh", "pipeline": 2}, tokens_per_rank=24, ranks_per_node=2),
        wire("smart-shadow", "bf16", {"pipeline": "smart", "shadowing": [0], "capacity_factor": 0.0},
             ranks_per_node=1),
        wire("redundant-f0", "fp8", {"redundant_experts": 4, "capacity_factor": 0.0}, steps=2,
             rebalance_to=(9.0, 1, 1, 1, 1, 1, 1, 3)),
        wire("adaptive-E2-rmax-pairwise", "fp8", {"parallel": "rmax", "alltoall": "pairwise"}, num_experts=2,
             ranks_per_node=2),
        wire("auto-f0-empty-rank", "fp8", {"capacity_factor": 0.0}, empty_ranks=(1,)),
        wire("bf16-model-ragged", "fp8", {"token_exchange": "ragged", "expert_kernel": "ragged"},
             dtype=torch.bfloat16),
    ]


def static_cases() -> list[Case]:
    """``step_shapes="static"`` (one rank only: several ranks refuse it): drops and none, each k,
    batch-prioritized order, a call's own factor, no tokens, the moving balancing bias, shared
    experts, bf16."""
    static = {"step_shapes": "static", "top_k": 2, "capacity_factor": 1.0}
    return [Case(f"static-{name}", {**static, **layer}, **extra) for name, layer, extra in (
        ("f1-drops", {}, {"tokens_per_rank": 24}),
        ("k1-f0.5-relu", {"top_k": 1, "capacity_factor": 0.5, "activation": "relu"}, {}),
        ("k3-f2-swiglu-no-bias", {"top_k": 3, "capacity_factor": 2.0, "activation": "swiglu", "bias": False}, {}),
        ("bpr-cosine", {"batch_prioritized_routing": True, "gate": "cosine", "cosine_projection_dim": 6}, {}),
        ("call-f0.25", {}, {"call": {"capacity_factor": 0.25, "top_k": 3}}),
        ("no-tokens", {}, {"tokens_per_rank": 0}),
        ("same-expert", {}, {"same_expert": True}),
        ("bias-balancing", {"expert_bias_update_rate": 0.05, "score_function": "sigmoid"}, {"steps": 3}),
        ("shared-gated-swiglu", {"num_shared_experts": 1, "shared_expert_gate": True, "activation": "swiglu"}, {}),
        ("bf16-swiglu", {"activation": "swiglu"}, {"dtype": torch.bfloat16, "tokens_per_rank": 24}),
    )]


def all_cases(device: str = "cpu") -> list[Case]:
    """Every case; on a CPU, the Triton ones only where Triton's interpreter runs them (conftest sets
    it without a GPU: on a GPU machine Triton compiles for CUDA and refuses CPU tensors)."""
    cases = grid_cases() + extra_cases() + bf16_cases() + wire_cases({"top_k": 2, "capacity_factor": 1.0})
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        cases = [case for case in cases if case.layer.get("kernel_backend") != "triton"]
    return cases


def _tokens(case: Case, rank: int, world_size: int) -> torch.Tensor:
    count = 0 if rank in {r % world_size for r in case.empty_ranks} else case.tokens_per_rank
    generator = torch.Generator().manual_seed(1000 + rank // mp_size(case, world_size))  # same over MP
    x = torch.randn(count, case.model_dim, generator=generator, dtype=case.dtype)
    if case.same_expert:
        x = x.abs() + 0.1
    if case.name == "3d-input-shape":
        x = x.view(3, -1, case.model_dim)
    return x


def _groups(case: Case, world: CaseWorld, cache: dict[tuple[int, int], ParallelGroups]) -> ParallelGroups:
    """One ParallelGroups per topology and MP size for the whole run (their groups are made once):
    on the case world's group, whose nodes hold ``case.ranks_per_node`` of its ranks each."""
    if world.size == 1 and not torch.distributed.is_initialized():
        return ParallelGroups.single_process()
    per_node = case.ranks_per_node if case.ranks_per_node and world.size % case.ranks_per_node == 0 else world.size
    mp = mp_size(case, world.size)
    if (per_node, mp) not in cache:
        model = torch.distributed.new_subgroups(group_size=mp)[0] if mp > 1 else None
        group = world.group if world.group is not None else torch.distributed.group.WORLD
        cache[per_node, mp] = ParallelGroups.from_group(group, Topology(world.world_size, per_node))
        cache[per_node, mp].model = model
    return cache[per_node, mp]


def _build(
    case: Case, rank: int, world_size: int, groups: ParallelGroups, world: dist.ProcessGroup | None = None
) -> tuple[ReferenceMoE, MoELayer]:
    torch.manual_seed(7)
    kwargs = dict(case.layer)
    planted_rates = PLANTED_RATES.get(kwargs.get("expert_kernel", "bmm"))
    if planted_rates is not None:
        kwargs["expert_kernel"] = "auto"
    execution = {  # how the layer runs, not what it computes: the reference has no such knobs
        "expert_kernel": kwargs.pop("expert_kernel", "bmm"),
        "kernel_backend": kwargs.pop("kernel_backend", "auto"),
        "alltoall": kwargs.pop("alltoall", "linear"),
        "profile": kwargs.pop("profile", None),
        "pipeline": kwargs.pop("pipeline", "auto"),
        "token_exchange": kwargs.pop("token_exchange", "auto"),
        "wire_dtype": kwargs.pop("wire_dtype", "exact"),
        "parallel": kwargs.pop("parallel", "expert"),
        "shadowing": kwargs.pop("shadowing", "off"),
        "redundant_experts": kwargs.pop("redundant_experts", 0),
        "balance": kwargs.pop("balance", "fixed"),
        "esp_size": kwargs.pop("esp_size", None),
        # the static step has static_cases() (auto would take it for every case on a GPU)
        "step_shapes": kwargs.pop("step_shapes", "dynamic"),
        "group": groups,
    }
    node_limit = _reference_node_limit(case, kwargs.pop("topology_gate", "off"), rank, world_size)
    if execution["parallel"] in MODEL_PARALLEL_SCHEDULES and groups.model is None:
        execution["parallel"] = "expert"  # no MP group on this world: the case runs as plain EP
        execution["alltoall"] = "linear" if execution["alltoall"] == "saa" else execution["alltoall"]
    if groups.model is None or world_size % (execution["esp_size"] or 1):
        execution["esp_size"] = None  # N_ESP does not fit this world: N_ESP = N_MP (or plain EP)
    if execution["parallel"] in ("r0", "r1", "rmid", "rmax"):
        execution["parallel"] = resolve_r(execution["parallel"], case.num_experts, world_size)
    reference = ReferenceMoE(case.model_dim, case.hidden_dim, case.num_experts, **kwargs, **node_limit).to(case.dtype)
    if execution["parallel"] == "s1":  # Parm's S1: each MP member routes its own partition
        reference.routing_groups = mp_size(case, world_size)
    # non-zero biases, so that their gradients and the shared layout are exercised
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith((".b1", ".b2", ".b3")):
                param.normal_(std=0.1)
        reference.gate.expert_bias.normal_(std=case.expert_bias_std)
        if case.same_expert:
            steer = -torch.arange(case.num_experts, dtype=case.dtype).unsqueeze(1)
            reference.gate.weight.copy_(steer.expand_as(reference.gate.weight) + 3.0 * (steer == 0))
    layer = MoELayer(case.model_dim, case.hidden_dim, case.num_experts, **execution, **kwargs,
                     topology_gate=case.layer.get("topology_gate", "off"))
    layer = layer.to(case.dtype)
    layer.load_full_state_dict(reference.state_dict())
    layer.planner.kernel_rates = planted_rates
    if world_size > 1:
        reference.global_load = functools.partial(_sum_over_ranks, group=world)
    return reference, layer


def _reference_node_limit(case: Case, share: str | float, rank: int, world_size: int) -> dict[str, Any]:
    """The topology gate's arguments of the reference: the experts of this rank's node (experts are
    numbered rank-major, E / W per rank) and the share."""
    if share == "off":
        return {}
    per_node = case.ranks_per_node if case.ranks_per_node and world_size % case.ranks_per_node == 0 else world_size
    per_rank = case.num_experts // world_size
    first = rank // per_node * per_node * per_rank
    return {"node_experts": range(first, first + per_node * per_rank), "remote_share": share}


def _sum_over_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def _compare(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None, case: Case,
             failures: list[str]) -> None:
    if expected is None and actual is None:
        return
    if expected is None:  # the reference runs on the CPU
        expected = torch.zeros_like(actual, device="cpu")
    if actual is None:
        actual = torch.zeros_like(expected)
    tolerance = GPU_FP32_TOLERANCE if actual.is_cuda and case.dtype == torch.float32 else TOLERANCES[case.dtype]
    tolerance = case.tolerance or tolerance
    actual = actual.cpu()  # the layer may run on a GPU; the reference runs on the CPU
    try:
        torch.testing.assert_close(actual, expected, **tolerance)
    except AssertionError as error:
        failures.append(f"{case.name}: {name}: {str(error).splitlines()[-3:]}")


def check_case(
    case: Case, rank: int, world_size: int, groups: ParallelGroups, device: str = "cpu",
    world: dist.ProcessGroup | None = None,
) -> list[str]:
    """Run one case on this rank, the layer on ``device``; return a list of mismatch descriptions
    (empty when equal). ``rank`` and ``world_size`` are in the case's ``world`` (None: all ranks)."""
    reference, layer = _build(case, rank, world_size, groups, world)
    layer = layer.to(device)
    failures: list[str] = []
    for step in range(case.steps):
        if step == 1 and case.rebalance_to:
            rebalance_layer(layer, case.rebalance_to)
        if 2 <= step < 2 + len(case.rebalance_later):
            rebalance_layer(layer, case.rebalance_later[step - 2])
        if step == 1 and case.pack_factor:
            per_rank = min(case.num_experts, case.num_experts // world_size * case.pack_factor)
            pack_layer(layer, per_rank)
            if layer.experts_per_rank != per_rank or layer.schedule.name != ("expert" if world_size == 1 else "packed"):
                failures.append(f"{case.name}: not packed to {per_rank} experts per rank")
        x = _tokens(case, rank, world_size)
        x_ref = x.clone().requires_grad_()
        x_layer = x.to(device, copy=True).requires_grad_()
        y_ref = reference(x_ref, **case.call)
        call = dict(case.call)
        if case.r_per_step:
            call["r"] = resolve_r(case.r_per_step[step % len(case.r_per_step)], case.num_experts, world_size)
        y_layer = layer(x_layer, **call)
        upstream = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(step), dtype=case.dtype)
        reference_loss = (y_ref * upstream).sum() + reference.aux_loss
        if reference_loss.requires_grad:  # an empty batch leaves the reference without a graph
            reference_loss.backward()
        # the layer always has a graph: its backward all-to-alls must run on every rank
        ((y_layer * upstream.to(device)).sum() + layer.aux_loss).backward()

        _compare(f"step{step} output", y_layer, y_ref, case, failures)
        _compare(f"step{step} aux_loss", layer.aux_loss.double(), reference.aux_loss.double(), case, failures)
        _compare(f"step{step} grad x", x_layer.grad, x_ref.grad, case, failures)
        _compare(f"step{step} expert_bias", layer.gate.expert_bias, reference.gate.expert_bias, case, failures)

        reference_grads = {
            n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in reference.named_parameters()
        }
        if world_size > 1 and not layer.placement.is_replicated:
            # an expert-parallel expert's gradient collects the tokens of every rank (of a packed
            # block: the block's); a replicated expert's holds this rank's tokens (the trainer sums
            # them like any replicated weight); MP members hold the same tokens, which count once
            block = groups.block(layer.placement.packed_group_size or world_size)
            for name, grad in reference_grads.items():
                if name.startswith("experts."):
                    reference_grads[name] = _sum_over_ranks(grad, block) / mp_size(case, world_size)
        expected_grads = shard_expert_state(reference_grads, layer.placement, rank)
        if "experts.b2" in expected_grads:  # only the shard that starts at hidden 0 adds b2
            adds = [shard.adds_output_bias for shard in layer.placement.local(rank)]
            expected_grads["experts.b2"] = expected_grads["experts.b2"] * torch.tensor(adds).unsqueeze(1)
        for name, param in layer.named_parameters():
            _compare(f"step{step} grad {name}", param.grad, expected_grads.get(name), case, failures)

        counts = torch.tensor(reference.tokens_per_expert or [0] * case.num_experts)
        dropped = torch.tensor(reference.dropped_per_expert or [0] * case.num_experts)
        if world_size > 1:
            mp = mp_size(case, world_size)
            counts, dropped = _sum_over_ranks(counts, world) // mp, _sum_over_ranks(dropped, world) // mp
        stats = layer.last_stats
        assert stats is not None
        assert stats.plan is not None
        if case.expected_alltoall and world_size > 1 and stats.plan.alltoall != case.expected_alltoall:
            failures.append(f"{case.name}: used {stats.plan.alltoall}, expected {case.expected_alltoall}")
        if stats.tokens_per_expert != counts.tolist():
            failures.append(f"{case.name}: tokens_per_expert {stats.tokens_per_expert} != {counts.tolist()}")
        if stats.dropped_per_expert != dropped.tolist():
            failures.append(f"{case.name}: dropped {stats.dropped_per_expert} != {dropped.tolist()}")
        reference.zero_grad()
        layer.zero_grad()
    return failures


def check_cases(
    rank: int, world_size: int, cases: list[Case], device: str = "cpu", ep_size: int | None = None
) -> tuple[int, list[str]]:
    """Worker entry point: run every case; return (cases run, all mismatches). ``ep_size``: the
    layers on the "ep" rows of a (dp, ep) DeviceMesh, each row a case world of its own (the
    reference over its ranks' tokens), the rows copies of each other."""
    failures: list[str] = []
    groups: dict[tuple[int, int], ParallelGroups] = {}
    world = CaseWorld.whole(rank, world_size) if ep_size is None else CaseWorld.mesh_row(world_size, ep_size)
    for case in cases:
        failures.extend(check_case(case, world.rank, world.size, _groups(case, world, groups), device, world.group))
    return len(cases), [f"rank {rank}: {f}" for f in failures]


@dataclass(frozen=True)
class CaseWorld:
    """The ranks a case runs over: the whole world, or this rank's row of a (dp, ep) mesh."""

    rank: int
    size: int
    group: dist.ProcessGroup | None  # None: the world
    world_size: int

    @classmethod
    def whole(cls, rank: int, world_size: int) -> CaseWorld:
        return cls(rank, world_size, None, world_size)

    @classmethod
    def mesh_row(cls, world_size: int, ep_size: int) -> CaseWorld:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
        group = mesh["ep"].get_group()
        return cls(dist.get_rank(group), ep_size, group, world_size)

