"""Settings of one MoE layer, validated once so that errors name the argument and the fix.

Runtime objects (process groups, profiles) never live here: the config is plain data that can be
saved, compared and printed.
"""

from __future__ import annotations

import difflib
import math
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any

GATES = ("softmax", "cosine")
"""Gate (router) kinds: ``softmax`` is a linear router, ``cosine`` Tutel's cosine router (C.3)."""

SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""How logits become routing scores: ``softmax`` over the experts, or an element-wise ``sigmoid`` (DeepSeek-V3)."""
GATE_PRECISIONS = ("fp32", "input")
"""Where the linear gate's logits are computed: ``fp32`` whatever the input (moeflow's default, as
DeepSeek-V3), or ``input`` in the input's dtype and only then cast to fp32 (Mixtral, Qwen-MoE)."""
ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")
"""The experts' activations; ``swiglu`` gives an expert three projections instead of two."""
EXPERT_KERNELS = ("auto", "bmm", "loop", "ragged")
"""How the experts' GEMMs run: one batched GEMM per projection (``bmm``), one ``mm`` per expert (``loop``),
the dropless ragged grouped GEMM over the received slots (``ragged``), or per call the faster of
``bmm`` and ``ragged`` for the slots it fills, by rates probed on the layer's shapes (``auto``,
:mod:`moeflow.perf.kernel_rates`; ``bmm`` where the schedule runs no ragged kernel)."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""The one dtype table: moeflow's names and their bytes per element (torch's dtypes:
:data:`moeflow.kernels.precision.DTYPES`)."""
DTYPE_NAMES = tuple(DTYPE_BYTES)
"""The compute dtypes a command line names (``--dtype``): fp32, or bf16/fp16 over fp32 master weights."""
KERNEL_BACKENDS = ("auto", "torch", "triton")
"""Who runs encode/decode and the ragged grouped GEMM: pure torch (the reference, everywhere),
Triton (an optional dependency; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``), or
``auto``: Triton for CUDA tensors when it is installed, torch otherwise."""
STEP_SHAPES = ("auto", "dynamic", "static")
"""How a step's shapes are set: ``dynamic`` from the routing counts read on the host (capacity, kept rows,
the plan); ``static`` from the shapes alone (capacity from the factor, no read of the counts: one rank,
capacity_factor > 0), a step a CUDA graph can capture; ``auto`` static on a GPU for a training call on
one rank with capacity_factor > 0, else dynamic (:mod:`moeflow.parallel.dispatchers.static`)."""
ALLTOALL_ALGORITHMS = ("linear", "2dh", "pairwise")
"""The all-to-all algorithms (:mod:`moeflow.comm.algorithms`)."""
SAA = "saa"
"""Parm's S2 combine with its all-to-all overlapped with the MP all-gather: an ``alltoall`` choice
only for the schedules behind tensor-parallel attention."""
ALLTOALL_CHOICES = (*ALLTOALL_ALGORITHMS, SAA, "auto")
"""The ``alltoall`` setting's values: an algorithm, Parm's ``saa``, or ``auto`` (planned per iteration)."""
PIPELINE_POLICIES = ("auto", "model", "search", "smart")
"""How the expert-parallel region is pipelined: planned per iteration (``auto``, ``model``,
``search``: capacity-chunk degrees and algorithms, with FasterMoE's smart schedule among the
candidates), or FasterMoE's smart schedule forced (``smart``); an int forces a capacity-chunk degree."""
GRADIENT_BUCKET_MB = 1.0
"""Megabytes at which a gradient bucket closes under ``grad_sync='overlap'`` (the trainer's default,
and the bucket the joint planner simulates for it)."""
MAX_PIPELINE_DEGREE = 64
"""The largest capacity-chunk degree ``pipeline`` may force."""
PADDED, RAGGED, DEDUP = "padded", "ragged", "dedup"
TOKEN_EXCHANGES = (PADDED, RAGGED, DEDUP)
"""How tokens travel between ranks: every slot of the capacity (``padded``), only the kept rows
(``ragged``), or the kept rows with a token sent once to each rank however many of its k experts
that rank holds (``dedup``, DeepEP's dispatch: :mod:`moeflow.parallel.dedup_exchange`)."""
TOKEN_EXCHANGE_CHOICES = (*TOKEN_EXCHANGES, "auto")
"""The ``token_exchange`` setting's values: one of :data:`TOKEN_EXCHANGES`, or ``auto``: each chunk
ragged where it leaves enough of its slots empty to pay for the gather and scatter, else padded."""
PAIRS = "pairs"
"""One row per (token, expert) pair: how transformers' own ``all_to_all`` expert parallelism sends."""
HF_EP_TOKEN_EXCHANGES = ("auto", DEDUP, PAIRS)
"""What moeflow's expert-parallel backend inside transformers sends (:mod:`moeflow.hf.expert_parallel`):
a token once to each rank holding one of its experts (``dedup``), one row per (token, expert)
pair (``pairs``, transformers' own layout), or ``auto``: by the batch's size."""
RAGGED_MIN_SAVING = 0.1
"""Under ``token_exchange='auto'``, the share of a chunk's slots (over all ranks) that must be empty
for it to travel ragged: a nearly full chunk goes padded, which skips the gather and scatter (on the
2-core VM a uniform load at f = 1 leaves about 1 % of the slots empty, and the padded exchange ran as
fast or faster)."""


EXACT_WIRE, BF16_WIRE, FP8_WIRE = "exact", "bf16", "fp8"
WIRE_DTYPES = (EXACT_WIRE, BF16_WIRE, FP8_WIRE)
"""The ``wire_dtype`` setting's values: how the expert-parallel exchange sends a row of tokens (and
of their gradients): as computed (``exact``), rounded to bfloat16 where the rows are wider
(``bf16``), or as e4m3 with one fp32 scale per row (``fp8``, DeepEP's format); always decoded into
the compute dtype, where every sum runs (:mod:`moeflow.comm.wire`)."""
FP8_SCALE_BYTES = 4
"""The fp32 scale an ``fp8`` row carries beside its e4m3 values."""


def wire_row_bytes(wire_dtype: str, model_dim: int, element_bytes: int) -> int:
    """Bytes one row of ``model_dim`` values of ``element_bytes`` each takes on the link under
    ``wire_dtype`` (what the exchange sends and the simulator prices)."""
    if wire_dtype == BF16_WIRE:
        return model_dim * min(element_bytes, 2)
    if wire_dtype == FP8_WIRE:
        return model_dim + FP8_SCALE_BYTES
    return model_dim * element_bytes


def empty_share(kept_rows: float, columns: int, slots: int) -> float:
    """The share of ``columns`` x ``slots`` capacity slots (every rank's, every expert's, of one
    chunk) that hold none of the ``kept_rows``: what ``token_exchange='auto'`` compares with
    :data:`RAGGED_MIN_SAVING`."""
    return 1.0 - kept_rows / max(1, columns * slots)


def ragged_min_saving(token_exchange: str) -> float:
    """The share of a chunk's slots that must be empty for it to travel ragged under ``token_exchange``:
    none when always ragged, :data:`RAGGED_MIN_SAVING` under ``auto``."""
    return 0.0 if token_exchange in (RAGGED, DEDUP) else RAGGED_MIN_SAVING


def dedup_row_share(num_experts: int, world_size: int, top_k: int) -> float:
    """The share of a dispatch's kept rows that still travel when a token crosses to each rank
    once, for choices spread uniformly (k distinct experts of E, E / W on each rank): the expected
    number of ranks a token's k choices reach, over k. What the planner and the simulator price;
    the layer reports what its routing actually saved (``RoutingStats.dedup_saved_rows``)."""
    if top_k <= 1 or world_size <= 1 or num_experts <= top_k:
        return 1.0
    local = num_experts // world_size
    missed = math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k)  # no choice on a given rank
    return world_size * (1.0 - missed) / top_k


def ffn_projections(activation: str) -> int:
    """GEMMs of one expert FFN: up and down, plus SwiGLU's gate projection (the one place that
    knows this; FLOP counts, cost models and parameter counts ask here)."""
    return 3 if activation == "swiglu" else 2


def validate_swiglu_clamp(
    activation: str, limit: float | None, alpha: float, up_offset: float, clamp_shared: bool
) -> None:
    """Clamped SwiGLU's settings: a positive finite limit on SwiGLU experts; alpha, the offset and the
    shared experts' clamp only with it."""
    if limit is None:
        if alpha != 1.0 or up_offset != 0.0:
            raise ValueError(f"swiglu_alpha={alpha} and swiglu_up_offset={up_offset} shape clamped SwiGLU: "
                             "set swiglu_limit too (or leave both at 1.0 and 0.0)")
        if clamp_shared:
            raise ValueError("swiglu_clamp_shared=True clamps the shared experts as the routed ones: set swiglu_limit")
        return
    if activation != "swiglu":
        raise ValueError(f"swiglu_limit clamps SwiGLU experts; activation={activation!r}: use activation='swiglu'")
    for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha), ("swiglu_up_offset", up_offset)):
        if not (isinstance(value, int | float) and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if limit <= 0:
        raise ValueError(f"swiglu_limit must be > 0 (the cap on the gate and up halves), got {limit!r}")


def resolve_normalize_gate(normalize_gate: bool | None, top_k: int) -> bool:
    """Tutel's rule: renormalise the k combine weights only when k > 1. At k = 1 renormalising
    makes every weight 1, so the router gets no gradient from the task loss; an explicit True
    there is honoured with a warning."""
    if normalize_gate is None:
        return top_k > 1
    if normalize_gate and top_k == 1:
        warnings.warn(
            "normalize_gate=True with top_k=1 sets every combine weight to 1, so the router learns only "
            "from the auxiliary loss; leave normalize_gate=None (normalise only when k > 1)",
            UserWarning, stacklevel=3,
        )
    return bool(normalize_gate)


@dataclass(frozen=True)
class LayerDims:
    """The dimensions of one MoE layer: model dim M, expert hidden size H, E experts, top-k, the
    GEMMs of one expert (2, SwiGLU 3) and whether they carry biases. The one shape type: the cost
    models (``RegionShape``), the simulator (``ModelSpec``), the benchmarks and the model read a
    layer's dimensions from here, so every formula over them has one set of names."""

    model_dim: int
    hidden_dim: int
    num_experts: int
    top_k: int = 2
    projections: int = 2
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("model_dim", "hidden_dim", "num_experts", "projections"):
            require_positive_int(name, getattr(self, name))
        validate_top_k(self.top_k, self.num_experts)
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias must be True or False, got {self.bias!r}")

    @property
    def expert_parameters(self) -> int:
        """Parameters of one expert: its projections' weights, and their biases when it has them (one
        per hidden projection, SwiGLU's up included, and the output's)."""
        weights = self.projections * self.model_dim * self.hidden_dim
        return weights + ((self.projections - 1) * self.hidden_dim + self.model_dim if self.bias else 0)


@dataclass(frozen=True)
class MoEConfig:
    """Everything that defines the function an MoE layer computes (and a few execution knobs).

    ``gate`` selects how logits are made (linear or cosine), ``score_function`` how logits become
    routing scores. ``capacity_factor`` follows Tutel: > 0 fixed factor, 0 the smallest capacity
    that drops nothing, < 0 the same capped at ``|f|`` times the factor-1 capacity.
    """

    model_dim: int
    hidden_dim: int
    num_experts: int
    top_k: int = 2
    capacity_factor: float = 1.0
    gate: str = "softmax"
    gate_precision: str = "fp32"
    gate_bias: bool = False  # gpt-oss: a learned bias on the linear gate's logits (not DeepSeek's selection bias)
    score_function: str = "softmax"
    activation: str = "gelu"
    normalize_gate: bool | None = None  # None: Tutel's rule, normalise only when k > 1
    batch_prioritized_routing: bool = False
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None  # the shared experts' hidden size; None: hidden_dim
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared experts' output times sigmoid(x . w)
    expert_bias_update_rate: float = 0.0
    expert_groups: int = 1  # DeepSeek-V3's n_group: pick experts only in the top_groups best groups
    top_groups: int = 1
    routed_scaling_factor: float = 1.0  # DeepSeek-V3: the combine weights times this (after normalising)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU (routed experts): gate <= this, |up| <= this
    swiglu_alpha: float = 1.0  # clamped SwiGLU's gate: g * sigmoid(alpha g)
    swiglu_up_offset: float = 0.0  # clamped SwiGLU's up half plus this (gpt-oss: 1)
    swiglu_clamp_shared: bool = False  # the shared experts' SwiGLU clamped as well (MiniMax-M3)
    cosine_projection_dim: int = 256
    cosine_min_temperature: float = 0.01
    check_finite: bool = False
    expert_kernel: str = "auto"
    kernel_backend: str = "auto"  # who runs encode/decode and the ragged GEMMs: torch, triton, or auto
    step_shapes: str = "auto"  # STEP_SHAPES: "static" sizes a one-rank step without reading the routing counts
    alltoall: str = "auto"
    pipeline: int | str = "auto"
    token_exchange: str = "auto"  # the expert-parallel exchange: "padded", "ragged" (kept rows only), "dedup" or "auto"
    wire_dtype: str = EXACT_WIRE  # how exchanged rows travel: "exact", "bf16" or "fp8" (moeflow.comm.wire)
    capacity_bucket: int = 128
    bias: bool = True
    parallel: str | int = "auto"
    tokens_per_rank_hint: int | None = None
    shadowing: str | tuple[int, ...] = "off"  # FasterMoE: "off", "auto" or the experts to shadow
    topology_gate: str | float = "off"  # FasterMoE §4.3: "off", "auto" or the share of tokens that may leave the node
    redundant_experts: int = 0  # EPLB: extra expert slots for replicas of hot experts (E + this slots in all)
    balance: str = "fixed"  # "fixed": the two settings above as given; "auto": off, shadowing or the slots per layer
    esp_size: int | None = None  # Parm: hidden shards per expert (N_ESP) behind an mp_group; None: the mp_group's size

    def __post_init__(self) -> None:
        require_positive_int("model_dim", self.model_dim)
        require_positive_int("hidden_dim", self.hidden_dim)
        require_positive_int("num_experts", self.num_experts)
        validate_top_k(self.top_k, self.num_experts)
        validate_expert_groups(self.expert_groups, self.top_groups, self.num_experts, self.top_k)
        validate_capacity_factor(self.capacity_factor)
        require_choice("gate", self.gate, GATES)
        require_choice("score_function", self.score_function, SCORE_FUNCTIONS)
        require_choice("gate_precision", self.gate_precision, GATE_PRECISIONS)
        if self.gate_bias and self.gate != "softmax":
            raise ValueError("gate_bias=True adds a bias to the linear gate's logits: use gate='softmax'")
        if self.gate_precision == "input" and self.gate != "softmax":
            raise ValueError(
                "gate_precision='input' applies to the linear gate: use gate='softmax' or gate_precision='fp32'"
            )
        require_choice("activation", self.activation, ACTIVATIONS)
        require_choice("expert_kernel", self.expert_kernel, EXPERT_KERNELS)
        require_choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        require_choice("step_shapes", self.step_shapes, STEP_SHAPES)
        if self.step_shapes == "static" and self.capacity_factor <= 0:
            raise ValueError(f"step_shapes='static' sizes capacity from capacity_factor > 0, got "
                             f"{self.capacity_factor!r} (its capacity is the routing's largest count, read on the "
                             "host): use capacity_factor > 0 or step_shapes='auto'")
        require_choice("alltoall", self.alltoall, ALLTOALL_CHOICES)
        validate_pipeline(self.pipeline)
        require_choice("token_exchange", self.token_exchange, TOKEN_EXCHANGE_CHOICES)
        require_choice("wire_dtype", self.wire_dtype, WIRE_DTYPES)
        require_positive_int("capacity_bucket", self.capacity_bucket)
        validate_parallel(self.parallel)
        object.__setattr__(self, "shadowing", validate_shadowing(self.shadowing, self.num_experts))
        validate_topology_gate(self.topology_gate)
        if self.topology_gate != "off" and self.expert_groups > 1:
            raise ValueError("topology_gate limits the experts a token may pick, as expert_groups does: use one of "
                             "them (topology_gate='off' or expert_groups=1)")
        validate_swiglu_clamp(self.activation, self.swiglu_limit, self.swiglu_alpha, self.swiglu_up_offset,
                              self.swiglu_clamp_shared)
        validate_redundant_experts(self.redundant_experts)
        validate_balance(self.balance, self.redundant_experts)
        if self.esp_size is not None:
            require_positive_int("esp_size", self.esp_size)
        if self.tokens_per_rank_hint is not None:
            require_positive_int("tokens_per_rank_hint", self.tokens_per_rank_hint)
        if self.normalize_gate is not None and not isinstance(self.normalize_gate, bool):
            raise ValueError(f"normalize_gate must be True, False or None (Tutel's rule), got {self.normalize_gate!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias must be True or False, got {self.bias!r}")
        if not (isinstance(self.routed_scaling_factor, int | float) and 0 < self.routed_scaling_factor < math.inf):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor!r}")
        for name in ("aux_loss_weight", "z_loss_weight", "expert_bias_update_rate"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(
                f"num_shared_experts must be an integer >= 0, got {self.num_shared_experts!r}"
            )
        if self.shared_hidden_dim is not None:
            require_positive_int("shared_hidden_dim", self.shared_hidden_dim)
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError("shared_expert_gate=True gates the shared experts: set num_shared_experts >= 1")
        require_positive_int("cosine_projection_dim", self.cosine_projection_dim)
        if not (0 < self.cosine_min_temperature < math.inf):
            raise ValueError(
                f"cosine_min_temperature must be > 0, got {self.cosine_min_temperature!r}"
            )

    @property
    def dims(self) -> LayerDims:
        """This layer's dimensions, in the shape type the cost models and the simulator read."""
        return LayerDims(self.model_dim, self.hidden_dim, self.num_experts, self.top_k,
                         ffn_projections(self.activation), self.bias)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MoEConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown MoE config key(s) {unknown}; valid keys are {sorted(known)}"
            )
        return cls(**values)


TUTEL_POSITIONAL = (
    "model_dim", "hidden_dim", "num_experts", "top_k", "capacity_factor", "gate", "activation", "normalize_gate",
    "batch_prioritized_routing", "aux_loss_weight", "z_loss_weight",
)
"""The settings Tutel's ``MOELayer`` takes by position, in its order (then ``group``)."""


def config_from_arguments(args: tuple[Any, ...], settings: dict[str, Any]) -> MoEConfig:
    """The :class:`MoEConfig` of Tutel-style layer arguments: positional in Tutel's order, then
    keywords. It declares no default: every omitted setting takes MoEConfig's."""
    if len(args) > len(TUTEL_POSITIONAL):
        raise TypeError(f"MoELayer takes at most {len(TUTEL_POSITIONAL)} settings by position "
                        f"({', '.join(TUTEL_POSITIONAL)}), then group; got {len(args)}: pass the rest by keyword")
    named = dict(zip(TUTEL_POSITIONAL, args, strict=False))
    if twice := sorted(named.keys() & settings.keys()):
        raise TypeError(f"MoELayer got {', '.join(twice)} both by position and by keyword: pass each once")
    known = [f.name for f in fields(MoEConfig)]
    for name in settings:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the settings are MoEConfig's: {', '.join(known)}"
            raise TypeError(f"MoELayer got an unexpected setting {name!r}; {hint}")
    return MoEConfig(**named, **settings)


def validate_expert_groups(expert_groups: object, top_groups: object, num_experts: int, top_k: int) -> None:
    """DeepSeek-V3's group-limited routing: E experts in ``expert_groups`` equal groups of at least
    two (a group's score is the sum of its two best experts), a token's k experts taken from its
    ``top_groups`` best groups, so those must hold at least k experts."""
    require_positive_int("expert_groups", expert_groups)
    require_positive_int("top_groups", top_groups)
    assert isinstance(expert_groups, int) and isinstance(top_groups, int)
    if expert_groups == 1:
        if top_groups != 1:
            raise ValueError(f"top_groups={top_groups} needs expert_groups > 1 (DeepSeek-V3's n_group)")
        return
    if num_experts % expert_groups or num_experts // expert_groups < 2:
        raise ValueError(
            f"num_experts={num_experts} cannot form expert_groups={expert_groups} equal groups of at least 2 "
            "experts; use an expert_groups that divides num_experts at most num_experts / 2 times"
        )
    selectable = top_groups * (num_experts // expert_groups)
    if top_groups > expert_groups or selectable < top_k:
        raise ValueError(
            f"top_groups={top_groups} of expert_groups={expert_groups} hold {selectable} experts, fewer than "
            f"top_k={top_k}, or more groups than exist; use top_groups in "
            f"[ceil(top_k * expert_groups / num_experts), expert_groups]"
        )


def validate_top_k(top_k: object, num_experts: int) -> int:
    """k must be an integer in [1, E]: each token picks k distinct experts."""
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an integer, got {top_k!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_k > num_experts:
        raise ValueError(
            f"top_k={top_k} is larger than num_experts={num_experts}: "
            "each token picks k distinct experts, so use top_k <= num_experts"
        )
    return top_k


def validate_pipeline(pipeline: object) -> int | str:
    """A policy name or a fixed degree in [1, MAX_PIPELINE_DEGREE]."""
    if isinstance(pipeline, str):
        require_choice("pipeline", pipeline, PIPELINE_POLICIES)
        return pipeline
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or not 1 <= pipeline <= MAX_PIPELINE_DEGREE:
        raise ValueError(
            f"pipeline must be one of {', '.join(PIPELINE_POLICIES)} or a degree between 1 and "
            f"{MAX_PIPELINE_DEGREE}, got {pipeline!r}"
        )
    return pipeline


def validate_parallel(parallel: object) -> str | int:
    """A schedule's name (the registry, :mod:`moeflow.parallel.registry`, checks which) or Tutel's
    r as an int >= 0 (checked against E and W by the layer)."""
    if isinstance(parallel, str):
        return parallel
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 0:
        raise ValueError(
            f"parallel must be one of the schedules' names (moeflow.parallel.registry.PARALLEL_CHOICES) or Tutel's r "
            f"(an integer >= 0), got {parallel!r}"
        )
    return parallel


SHADOWING_POLICIES = ("off", "auto")
"""The ``shadowing`` settings that name a policy (the other value is a list of experts)."""


def validate_shadowing(shadowing: object, num_experts: int) -> str | tuple[int, ...]:
    """FasterMoE's dynamic shadowing: "off", "auto" (Algorithm 1 each iteration, on a calibrated
    profile) or a fixed list of experts, returned as a sorted tuple."""
    if isinstance(shadowing, str) and shadowing in SHADOWING_POLICIES:
        return shadowing
    if isinstance(shadowing, list | tuple) and all(
        isinstance(e, int) and not isinstance(e, bool) and 0 <= e < num_experts for e in shadowing
    ) and len(set(shadowing)) == len(shadowing):
        return tuple(sorted(shadowing))
    raise ValueError(
        f"shadowing must be 'off', 'auto' or a list of distinct experts in [0, {num_experts}), got {shadowing!r}"
    )


def validate_redundant_experts(redundant: object) -> None:
    """EPLB's extra slots: a count >= 0 (what they run beside is the registry's rule)."""
    if not isinstance(redundant, int) or isinstance(redundant, bool) or redundant < 0:
        raise ValueError(f"redundant_experts must be an int >= 0 (extra expert slots), got {redundant!r}")


BALANCE_CHOICES = ("fixed", "auto")
"""The ``balance`` setting's values: ``fixed`` runs ``shadowing`` and ``redundant_experts`` as set;
``auto`` picks, per layer and each time its recorded load rebalances it, the fastest of no
balancing, FasterMoE's shadowing (``auto``) and EPLB's ``redundant_experts`` slots (the cost model
of :mod:`moeflow.perf.balance`)."""


def validate_balance(balance: object, redundant: int) -> None:
    """``auto`` needs the slots it may choose (that it leaves shadowing off is the registry's rule)."""
    require_choice("balance", balance, BALANCE_CHOICES)
    if balance == "auto" and redundant < 1:
        raise ValueError("balance='auto' chooses among off, shadowing and EPLB's redundant slots: set "
                         "redundant_experts > 0 (the slots it may place), or balance='fixed'")


FASTERMOE_REMOTE_SHARE = 0.14
"""FastMoE's default share of a rank's tokens its topology-aware gate lets leave the node
(``FMOE_TOPO_OUTGOING_FRACTION``), for when no profile gives the bandwidth ratio."""


def validate_topology_gate(setting: object) -> None:
    """FasterMoE's topology-aware gate: "off", "auto" (the share W_net / (M W_local) from a
    calibrated profile) or the share itself, a number in [0, 1]."""
    if setting in ("off", "auto"):
        return
    if isinstance(setting, int | float) and not isinstance(setting, bool) and 0 <= setting <= 1:
        return
    raise ValueError(
        f"topology_gate must be 'off', 'auto' or the share of a rank's tokens allowed to pick an expert on another "
        f"node, a number in [0, 1] (FastMoE uses {FASTERMOE_REMOTE_SHARE}); got {setting!r}"
    )


def switchable_rs(num_experts: int, world_size: int) -> tuple[int, ...]:
    """Tutel's valid r on one storage layout: 0 (ZeRO-style data parallel) and, with S = W / E
    hidden shards per expert, every divisor of S (r = 1 is EP+DP, r = S is EP+MP); {0, 1} when
    W <= E. Tutel's code, like this, needs r | S so that every weight-gather group has S / r ranks."""
    if world_size <= num_experts:
        return (0, 1)
    shards = world_size // num_experts
    return (0, *(r for r in range(1, shards + 1) if shards % r == 0))


def check_switchable_layout(num_experts: int, world_size: int, hidden_dim: int) -> None:
    """The one storage layout every r runs on exists for this E, W and H."""
    if world_size <= num_experts and num_experts % world_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the group size {world_size}; Tutel's r needs a "
            f"multiple of {world_size} experts (or a group size that is a multiple of {num_experts})"
        )
    if world_size > num_experts and world_size % num_experts:
        raise ValueError(
            f"the group size {world_size} is larger than num_experts={num_experts} but not a multiple of it; "
            f"Tutel's r shards each expert over W / E ranks: use {world_size // num_experts * num_experts} or "
            f"{(world_size // num_experts + 1) * num_experts} ranks, or a divisor of {world_size} experts"
        )
    if world_size > num_experts and hidden_dim % (world_size // num_experts):
        raise ValueError(
            f"hidden_dim={hidden_dim} cannot be split over W / E = {world_size // num_experts} ranks per expert; "
            "use a hidden_dim divisible by it"
        )


def validate_r(r: int, num_experts: int, world_size: int) -> int:
    """r must be one of :func:`switchable_rs` for this E and W."""
    valid = switchable_rs(num_experts, world_size)
    if r not in valid:
        raise ValueError(
            f"parallel={r} is not a valid r for {num_experts} experts on {world_size} ranks; r must be in "
            f"[0, ceil(W/E)] and divide W/E: choose one of {', '.join(map(str, valid))}"
        )
    return r


def call_settings(
    config: MoEConfig, top_k: int | None, capacity_factor: float | None, r: int | None, schedule: str,
    takes_r: bool, world_size: int,
) -> tuple[int, float]:
    """A forward's k and capacity factor (the config's unless given), checked, and its r: only for a
    ``schedule`` that ``takes_r`` (Tutel's switchable parallelism)."""
    if r is not None:
        validate_call_r(r, takes_r, schedule, config.num_experts, world_size)
    k = validate_top_k(config.top_k if top_k is None else top_k, config.num_experts)
    validate_expert_groups(config.expert_groups, config.top_groups, config.num_experts, k)
    return k, validate_capacity_factor(config.capacity_factor if capacity_factor is None else capacity_factor)


def validate_call_r(r: object, takes_r: bool, schedule: str, num_experts: int, world_size: int) -> int:
    """A forward's ``r`` (Tutel's adaptive_r): only a switchable schedule takes one, and it must
    be one of :func:`switchable_rs`."""
    if not takes_r:
        raise ValueError(
            f"r={r!r} switches Tutel's parallelism, which needs MoELayer(..., parallel='adaptive' or an int r); "
            f"this layer runs parallel={schedule!r}"
        )
    if isinstance(r, bool) or not isinstance(r, int):
        raise ValueError(f"r must be an integer, got {r!r}")
    return validate_r(r, num_experts, world_size)


def validate_capacity_factor(capacity_factor: object) -> float:
    """``capacity_factor`` as a float; a non-number or a non-finite value raises."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, int | float):
        raise ValueError(f"capacity_factor must be a number, got {capacity_factor!r}")
    if not math.isfinite(capacity_factor):
        raise ValueError(
            f"capacity_factor must be finite, got {capacity_factor!r}; "
            "use 0 for 'never drop a token'"
        )
    return float(capacity_factor)


def renamed_settings(values: dict[str, Any], renames: dict[str, str], source: str) -> dict[str, Any]:
    """``values`` with each old key of ``renames`` (old -> new) under its new name and one
    FutureWarning per old key, so files and checkpoints written before a rename keep loading; both
    spellings at once are refused (they could disagree)."""
    values = dict(values)
    for old, new in renames.items():
        if old not in values:
            continue
        if new in values:
            raise ValueError(f"{source}: both {old!r} and {new!r} are given; {old!r} is the old name of {new!r}, "
                             f"keep only {new!r}")
        warnings.warn(f"{source}: the key {old!r} is renamed {new!r}; {old}={values[old]!r} reads as the same "
                      "setting", FutureWarning, stacklevel=3)
        values[new] = values.pop(old)
    return values


def require_positive_int(name: str, value: object) -> None:
    """Raise unless ``value`` is an integer >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise unless ``value`` is one of ``choices``, naming them."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


MODEL_MOE_DEFAULTS = {"model_dim": 256, "hidden_dim": 512, "num_experts": 8, "capacity_factor": 0.0}
"""The MoE settings of the default language model where they differ from the layer's own defaults:
with :class:`MoEConfig`'s defaults, the one source of the trainer's MoE defaults. Dropless (capacity
factor 0), as Megatron-Core and torchtitan train: on the default 200-step run it reached the same
validation loss in the same time as Tutel's 1.25 (docs/benchmarks/2026-11-30-dropless-default.md),
which drops up to two thirds of a layer's assignments while its routers are young."""


def model_moe_defaults() -> MoEConfig:
    """The default language model's MoE layer settings."""
    return MoEConfig(**MODEL_MOE_DEFAULTS)
