"""The trainer's settings: one flat dataclass, so that a flag, a config-file key and a saved key are
the same name. Validated in the launching process, before any worker starts."""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeflow.config import (
    DTYPE_NAMES,
    FASTERMOE_REMOTE_SHARE,
    GRADIENT_BUCKET_MB,
    SHADOWING_POLICIES,
    MoEConfig,
    check_switchable_layout,
    model_moe_defaults,
    renamed_settings,
    require_choice,
    require_positive_int,
    validate_r,
    validate_topology_gate,
)
from moeflow.data import TOKENIZERS
from moeflow.metrics.alerts import HealthRules
from moeflow.training.pipeline_settings import check_pipeline

if TYPE_CHECKING:
    from moeflow.models import TransformerConfig

BACKENDS = ("gloo", "nccl")
LEGACY_GATES = ("plain", "topology")
"""The values of ``gate``, the old name of ``topology_gate`` (MoEConfig's ``gate`` is the router's kind)."""
GRAD_SYNC_MODES = ("after", "overlap", "lina")
"""``grad_sync``: how the replicated gradients are all-reduced (:mod:`moeflow.training.grad_sync`)."""
_MOE = model_moe_defaults()
HEALTH_RULES = HealthRules()
"""The monitor's alert rules a run takes unless its ``alert_*`` settings say otherwise."""
SCRATCH_LR = (3e-3, 3e-4)
"""The peak and final learning rates of a model trained from scratch (moeflow's own small models)."""
FINE_TUNING_LR = (5e-5, 5e-6)
"""The peak and final learning rates of a --hf fine-tuning run: transformers' Trainer's default
peak. At the from-scratch rate a fine-tuned Qwen3-MoE-like model's router collapsed within 10 steps."""
MODEL_BALANCING = "model"
"""``aux_loss_weight``'s name for a --hf model's own balancing loss weight (its router_aux_loss_coef)."""
FINAL_LR_DIVISOR = 10
"""A given peak learning rate's schedule ends at the peak over this, unless min_lr is given."""


@dataclass(frozen=True)
class TrainConfig:
    """Defaults train a 4-block, 8-expert top-2 model on 2 gloo workers in a few minutes on 2 cores."""

    # data
    data: str | None = None  # None: the Python standard library's sources
    hf: str | None = None  # a transformers model directory to fine-tune instead of moeflow's own model
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    val_percent: float = 5.0
    # model
    context: int = 128
    layers: int = 4
    heads: int = 4
    # the MoE layers: defaults from MoEConfig (moeflow.config), the one source of them
    model_dim: int = _MOE.model_dim
    hidden_dim: int = _MOE.hidden_dim  # every expert's and dense FFN's (was ffn_hidden)
    num_experts: int = _MOE.num_experts
    top_k: int = _MOE.top_k
    moe_every: int = 1
    capacity_factor: float | None = None  # None: the default model's (dropless); with hf, dropless as trained
    eval_capacity_factor: float = 0.0
    aux_loss_weight: str | float | None = None  # None: MoEConfig's, with hf the model's if it turns it on; "model"
    activation: str = _MOE.activation
    pipeline: int | str = _MOE.pipeline
    alltoall: str = _MOE.alltoall
    token_exchange: str = _MOE.token_exchange  # padded | ragged (only kept tokens travel) | dedup | auto
    wire_dtype: str = _MOE.wire_dtype  # exact | bf16 | fp8: how the exchanged rows travel
    expert_kernel: str = _MOE.expert_kernel  # bmm | loop | ragged (only the filled slots compute)
    parallel: int | str = _MOE.parallel  # expert | replicated | adaptive | auto | Tutel's r (an int)
    ep_size: int | None = None  # experts over this many consecutive workers, copied over workers / ep_size; None: all
    ranks_per_node: int | None = None  # workers per node, node-major; None: the launcher's, or one node
    mp_size: int = 1  # tensor-parallel attention over this many consecutive workers (Parm's MP)
    esp_size: int | None = None  # Parm's N_ESP: hidden shards per expert behind --mp-size; None: mp_size
    pp_size: int = 1  # pipeline stages over this many groups of consecutive workers (outermost); 1: none
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zbv | dualpipev (torch.distributed.pipelining's)
    microbatches: int | None = None  # with --pp-size: micro-batches a step; None: the schedule's stage count
    pp_overlap: bool = True  # dualpipev: a paired forward and backward side by side (where there is an expert group)
    profile: str | None = None  # a calibrated cluster profile for the planner
    plan: str | None = None  # a plan file (moeflow plan --out): its settings, and its prediction in summary.json
    shadowing: str = "off"  # FasterMoE's dynamic shadowing of every MoE layer: off | auto (needs --profile)
    topology_gate: str | float = "off"  # FasterMoE's topology-aware gate: off | auto (--profile's share) | a share
    redundant_experts: int = 0  # EPLB: extra expert slots per MoE layer for replicas of hot experts
    balance: str = _MOE.balance  # fixed | auto (per layer: off, shadowing or the slots, from the recorded load)
    rebalance_interval: int = 20  # with redundant experts: place the slots every this many steps
    rebalance_window: int = 20  # ... for the load of this many last steps
    expert_packing: str = "off"  # Lina: off | auto (double experts per worker while it pays) | N experts per worker
    packing_warmup: int = 10  # auto packing: the first decision after this many steps (Lina's)
    packing_interval: int = 4  # ... then every this many steps
    # gradient synchronization of the replicated parameters (moeflow.training.grad_sync)
    grad_sync: str = "after"  # after | overlap (DDP buckets) | lina (micro-ops that yield to all-to-alls)
    microop_mb: float = 1.0  # lina: the size of a gradient all-reduce micro-op
    bucket_mb: float = GRADIENT_BUCKET_MB  # overlap: the size at which a gradient bucket closes
    # optimization
    steps: int = 200
    stop_at: int | None = None  # end this invocation after this step (checkpointed); --resume goes on
    batch_size: int = 16  # sequences per data rank and step
    lr: float | None = None  # None: SCRATCH_LR's, or FINE_TUNING_LR's with --hf (peak_lr resolves it)
    min_lr: float | None = None  # None: the default's, or lr / FINAL_LR_DIVISOR (final_lr resolves it)
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_nonfinite_steps: int = 3  # steps in a row with a NaN/inf loss (each skipped) before the job stops
    seed: int = 0
    dtype: str = "fp32"
    # run
    workers: int = 2
    backend: str = "gloo"
    threads_per_worker: int = 1
    eval_interval: int = 40
    eval_windows: int = 64  # validation windows, split over the workers
    checkpoint_interval: int = 100
    keep_checkpoints: int = 2
    run_dir: str | None = None  # default: runs/<timestamp>
    progress: bool = True
    collective_timeout_s: float = 60.0
    # the MoE's health (moeflow.metrics): where it goes besides metrics.jsonl, and when it alerts
    tensorboard: bool = False  # TensorBoard event files under <run-dir>/tensorboard (the tensorboard extra)
    metrics_csv: bool = False  # <run-dir>/metrics.csv, a row per step
    alert_collapse_steps: int = HEALTH_RULES.collapse_steps
    alert_dead_window: int = HEALTH_RULES.dead_window
    alert_dropped_share: float = HEALTH_RULES.max_dropped_share
    alert_alltoall_share: float = HEALTH_RULES.max_alltoall_share

    def __post_init__(self) -> None:
        positive = ("vocab_size", "steps", "batch_size", "workers", "mp_size", "threads_per_worker", "eval_interval",
                    "eval_windows", "checkpoint_interval", "keep_checkpoints", "rebalance_interval",
                    "rebalance_window", "packing_warmup", "packing_interval", "max_nonfinite_steps")
        for name in positive:
            require_positive_int(name, getattr(self, name))
        require_choice("shadowing", self.shadowing, SHADOWING_POLICIES)
        validate_topology_gate(self.topology_gate)
        if self.topology_gate == "auto" and self.profile is None:
            raise ValueError("--topology-gate auto takes the share of tokens that may leave a node from --profile's "
                             "bandwidths: pass --profile, or the share itself, e.g. --topology-gate "
                             f"{FASTERMOE_REMOTE_SHARE} (FastMoE's default)")
        require_choice("grad_sync", self.grad_sync, GRAD_SYNC_MODES)
        for name in ("microop_mb", "bucket_mb"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number of megabytes > 0, got {value!r}")
        self._check_aux_loss_weight()
        self.health_rules()  # its own checks, named by the fields here
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package: pip install 'moeflow[tensorboard]' (make "
                             "setup installs it), or leave --tensorboard off (metrics.jsonl holds the same figures)")
        moe = self.model_config(self.vocab_size).moe  # the architecture's own checks
        if self.context < 2:
            raise ValueError(f"context must be at least 2 tokens, got {self.context}")
        require_choice("tokenizer", self.tokenizer, TOKENIZERS)
        require_choice("backend", self.backend, BACKENDS)
        require_choice("dtype", self.dtype, DTYPE_NAMES)
        self._check_nodes()
        check_pipeline(self)
        self._check_expert_parallel_size()
        if self.hf is None:
            self._check_parallel()
        elif self.mp_size > 1:
            self._check_tensor_parallel_layout()  # the model's heads and experts: check_hf_training
        self._check_fastermoe(moe)
        self._check_packing(moe)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "collective_timeout_s"):
            value = getattr(self, name)
            if value is None and name in ("lr", "min_lr"):
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.final_lr > self.peak_lr:
            raise ValueError(f"min_lr={self.final_lr} exceeds lr={self.peak_lr}; the schedule decays from lr to "
                             "min_lr")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.stop_at is not None and not (isinstance(self.stop_at, int) and 1 <= self.stop_at <= self.steps):
            raise ValueError(f"stop_at must be a step in [1, steps={self.steps}], got {self.stop_at!r}")

    def health_rules(self) -> HealthRules:
        """When the trainer's monitor alerts (the ``alert_*`` settings)."""
        try:
            return replace(HEALTH_RULES, collapse_steps=self.alert_collapse_steps, dead_window=self.alert_dead_window,
                           max_dropped_share=self.alert_dropped_share, max_alltoall_share=self.alert_alltoall_share)
        except ValueError as error:
            names = {"collapse_steps": "alert_collapse_steps", "dead_window": "alert_dead_window",
                     "max_dropped_share": "alert_dropped_share", "max_alltoall_share": "alert_alltoall_share"}
            message = str(error)
            for rule, setting in names.items():
                message = message.replace(f"HealthRules.{rule}", setting)
            raise ValueError(message) from None

    def _check_aux_loss_weight(self) -> None:
        weight = self.aux_loss_weight
        if weight == MODEL_BALANCING and self.hf is None:
            raise ValueError(f"aux_loss_weight={MODEL_BALANCING!r} takes a --hf model's router_aux_loss_coef: give "
                             "--hf, or a number")
        if isinstance(weight, str) and weight != MODEL_BALANCING:
            raise ValueError(f"aux_loss_weight must be a number >= 0 or {MODEL_BALANCING!r} (with --hf), got "
                             f"{weight!r}")  # a number is MoEConfig's to check

    def _check_parallel(self) -> None:
        """The MoE layers' schedule fits the workers (and the tensor-parallel attention, if any)."""
        from moeflow.parallel.registry import (
            MODEL_PARALLEL_SCHEDULES,
            PARALLEL_SCHEDULES,
            REPLICATING_SCHEDULES,
            check_parallel,
            experts_must_divide,
            is_switchable,
        )

        check_parallel(self.parallel)
        if self.mp_size > 1:
            self._check_tensor_parallel()
            return
        if self.esp_size is not None:
            raise ValueError("--esp-size shards the experts of Parm's schedules behind tensor-parallel attention: "
                             "set --mp-size > 1 too, or leave --esp-size unset")
        if self.parallel in MODEL_PARALLEL_SCHEDULES:
            raise ValueError(
                f"--parallel {self.parallel} runs behind tensor-parallel attention: add --mp-size N (N > 1 "
                f"workers per attention group), or use auto, an int r or one of "
                f"{', '.join(name for name in PARALLEL_SCHEDULES if name not in MODEL_PARALLEL_SCHEDULES)}"
            )
        experts_over, name = self.expert_workers, self.expert_workers_setting
        if is_switchable(self.parallel) and experts_over > self.num_experts:
            check_switchable_layout(self.num_experts, experts_over, self.hidden_dim)
        if isinstance(self.parallel, int):
            validate_r(self.parallel, self.num_experts, experts_over)
        elif self.num_experts % experts_over and experts_must_divide(self.parallel):
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by {name}={experts_over}; experts are "
                f"split evenly over the {name}, so use a multiple of {experts_over} experts, a smaller "
                f"--{name.replace('_', '-')} or --parallel {' or '.join(REPLICATING_SCHEDULES)}"
            )

    @property
    def expert_workers(self) -> int:
        """The workers each MoE layer places its experts over: ``ep_size``, or every worker of a
        pipeline stage (every worker without a pipeline)."""
        return self.ep_size or self.stage_workers

    @property
    def stage_workers(self) -> int:
        """The workers that run each pipeline stage (``workers / pp_size``; every worker without one)."""
        return self.workers // self.pp_size

    @property
    def expert_workers_setting(self) -> str:
        """The setting that gives :attr:`expert_workers`, for messages: ``ep_size`` or ``workers``."""
        return "ep_size" if self.ep_size else "workers"

    def _check_nodes(self) -> None:
        """--ranks-per-node N: the workers sit N to a node, node-major."""
        if self.ranks_per_node is None:
            return
        require_positive_int("ranks_per_node", self.ranks_per_node)
        if self.workers % self.ranks_per_node:
            raise ValueError(f"workers={self.workers} is not a multiple of ranks_per_node={self.ranks_per_node}: "
                             "every node holds the same number of workers")

    def _check_expert_parallel_size(self) -> None:
        """--ep-size N: the experts over N consecutive workers, those groups copies of each other over
        the data-parallel rest; a layout that cannot be is refused here."""
        if self.ep_size is None or self.ep_size == self.stage_workers:
            return
        require_positive_int("ep_size", self.ep_size)
        if self.stage_workers % self.ep_size:
            workers = "workers" if self.pp_size == 1 else "the workers of a pipeline stage (workers / pp_size)"
            raise ValueError(f"{workers}={self.stage_workers} is not a multiple of ep_size={self.ep_size}: they form "
                             f"data-parallel copies of ep-size expert-parallel workers")
        if self.ep_size % self.mp_size:
            raise ValueError(f"ep_size={self.ep_size} is not a multiple of mp_size={self.mp_size}: each expert group "
                             "holds whole tensor-parallel groups (Parm's MP inside its EP group)")
        from moeflow.parallel.registry import REPLICATING_SCHEDULES

        if self.parallel in REPLICATING_SCHEDULES:
            raise ValueError(f"--parallel {self.parallel} holds every expert on every worker, so --ep-size has nothing "
                             "to split: drop --ep-size, or use --parallel expert")

    def _check_fastermoe(self, moe: MoEConfig) -> None:
        """The registry's combination rules for the layers' settings, checked here because the
        layers would refuse only once the workers run; ``auto`` shadowing prices with a profile."""
        from moeflow.parallel.registry import check_techniques

        if self.balance == "auto" and self.profile is None:
            raise ValueError("--balance auto prices no balancing, shadowing and redundant slots with the cost model: "
                             "pass --profile <a calibrated cluster profile> (moeflow calibrate) or use --balance fixed")
        if self.shadowing == "auto" and self.profile is None:
            raise ValueError("--shadowing auto decides which experts to shadow with FasterMoE's cost model: pass "
                             "--profile <a calibrated cluster profile> (moeflow calibrate) or use --shadowing off")
        if self.hf is not None:
            return  # the model's expert count is read from it: check_hf_training checks these
        check_techniques(moe, self.layer_schedule())
        self.check_expert_slots(self.num_experts)

    def check_expert_slots(self, num_experts: int) -> None:
        """EPLB's slots split evenly over the expert group's workers."""
        over = self.expert_workers
        if self.redundant_experts and (num_experts + self.redundant_experts) % over:
            raise ValueError(
                f"--redundant-experts {self.redundant_experts}: the {num_experts} + {self.redundant_experts} "
                f"expert slots must split evenly over the {over} workers of {self.expert_workers_setting}; choose a "
                f"value that makes the sum a multiple of {over}"
            )

    def _check_packing(self, moe: MoEConfig) -> None:
        """Lina's packing re-places the expert-parallel layers (a --hf model's: checked by
        check_hf_training, which knows its expert count)."""
        from moeflow.training.packing import parse_packing

        packing = parse_packing(self.expert_packing)
        if packing == "off":
            return
        if self.mp_size > 1:
            raise ValueError("--expert-packing re-places the experts under the expert-parallel schedule, which "
                             "tensor-parallel attention does not run: drop --mp-size, or use --expert-packing off")
        if self.hf is None:
            self.check_expert_packing(moe)

    def check_expert_packing(self, moe: MoEConfig) -> None:
        """Lina's packing of ``moe``'s layers over the expert group, where asked."""
        from moeflow.training.packing import check_packing, parse_packing

        packing = parse_packing(self.expert_packing)
        if packing != "off":
            least = moe.num_experts // self.expert_workers
            check_packing(moe, self.layer_schedule(moe.num_experts), self.expert_workers,
                          packing if isinstance(packing, int) else least)

    def layer_schedule(self, num_experts: int | None = None) -> str:
        """The schedule the MoE layers of ``num_experts`` experts (unset: this config's model's; a
        --hf model's own count) build, before a profile's choice for ``auto``."""
        from moeflow.parallel.registry import expected_schedule

        return expected_schedule(self.parallel, num_experts or self.num_experts, self.expert_workers, self.mp_size)

    def _check_tensor_parallel(self) -> None:
        """--mp-size N: attention over N workers, Parm's schedules for the MoE layers behind it."""
        self._check_tensor_parallel_layout()
        if self.heads % self.mp_size:
            raise ValueError(f"heads={self.heads} cannot be split over mp_size={self.mp_size}; use an mp_size "
                             "that divides the heads")
        self.check_expert_shards(self.num_experts, self.hidden_dim)

    def _check_tensor_parallel_layout(self) -> None:
        """--mp-size N over the workers, with a schedule that runs behind tensor-parallel attention."""
        from moeflow.parallel.registry import AUTO, MODEL_PARALLEL_SCHEDULES

        if self.workers % self.mp_size:
            raise ValueError(f"workers={self.workers} is not a multiple of mp_size={self.mp_size}; "
                             "tensor-parallel groups are mp_size consecutive workers")
        if self.parallel not in (AUTO, *MODEL_PARALLEL_SCHEDULES):
            raise ValueError(
                f"--parallel {self.parallel} does not run behind tensor-parallel attention; with --mp-size use "
                f"auto (Parm's per-iteration S1/S2 choice) or one of {', '.join(MODEL_PARALLEL_SCHEDULES)}"
            )

    def check_expert_shards(self, num_experts: int, hidden_dim: int | None) -> None:
        """Parm's experts behind --mp-size: ``num_experts`` over the expert-parallel groups, each
        expert's ``hidden_dim`` over the esp_size shards (None: checked where the layers are built)."""
        from moeflow.perf.parm import shard_count

        esp, experts_over = shard_count(self.mp_size, self.esp_size), self.expert_workers
        if experts_over % esp:
            raise ValueError(f"esp_size={esp} hidden shards per expert must divide "
                             f"{self.expert_workers_setting}={experts_over}")
        expert_groups = experts_over // esp
        if num_experts % expert_groups or (hidden_dim is not None and hidden_dim % esp):
            raise ValueError(
                f"num_experts={num_experts} over {expert_groups} expert-parallel groups with hidden_dim="
                f"{hidden_dim} over esp_size={esp} shards: use a multiple of {expert_groups} experts "
                f"and a hidden_dim divisible by {esp} (or another --ep-size, --esp-size or --mp-size)"
            )

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """The architecture, with the vocabulary of the prepared tokenizer."""
        from moeflow.models import TransformerConfig

        settings = {name: getattr(self, name) for name in MODEL_SETTINGS}
        return TransformerConfig.build(
            vocab_size=vocab_size, tokens_per_rank_hint=self.batch_size * self.context,
            **{name: value for name, value in settings.items()
               if value is not None and value != MODEL_BALANCING},  # None: MoEConfig's; the --hf model's own
        )

    @property
    def peak_lr(self) -> float:
        """The learning rate after warmup: ``lr``, else :data:`FINE_TUNING_LR`'s with --hf, else
        :data:`SCRATCH_LR`'s."""
        return self.lr if self.lr is not None else self._default_lrs[0]

    @property
    def final_lr(self) -> float:
        """The learning rate at the last step: ``min_lr``, else a given ``lr`` over
        :data:`FINAL_LR_DIVISOR`, else the default's."""
        if self.min_lr is not None:
            return self.min_lr
        return self.lr / FINAL_LR_DIVISOR if self.lr is not None else self._default_lrs[1]

    @property
    def _default_lrs(self) -> tuple[float, float]:
        return FINE_TUNING_LR if self.hf is not None else SCRATCH_LR

    def resolved(self) -> dict[str, dict[str, Any]]:
        """The settings a run resolves from defaults, each with its value and where it came from."""
        default = "the fine-tuning default (transformers' Trainer's)" if self.hf is not None else \
            "the from-scratch default"
        peak_from = "--lr" if self.lr is not None else default
        final_from = ("--min-lr" if self.min_lr is not None else
                      f"--lr / {FINAL_LR_DIVISOR}" if self.lr is not None else default)
        return {"lr": {"value": self.peak_lr, "from": peak_from},
                "min_lr": {"value": self.final_lr, "from": final_from}}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, values: dict[str, Any]) -> TrainConfig:
        """This config with ``values`` set. A new worker count without an ``ep_size`` spreads the
        experts over every worker (a saved --ep-size need not divide the new count)."""
        values = checked_keys(values)
        if "workers" in values and "ep_size" not in values:
            values = {**values, "ep_size": None}
        return replace(self, **values)

    def save(self, path: Path, resolved: dict[str, dict[str, Any]] | None = None) -> None:
        """The settings, and under ``"resolved"`` those resolved from defaults (and ``resolved``'s:
        what a --hf model sets), each with where it came from."""
        from moeflow.files import write_atomic

        settings = {**self.to_dict(), "resolved": {**self.resolved(), **(resolved or {})}}
        write_atomic(path, json.dumps(settings, indent=2) + "\n")


FIELD_HELP: dict[str, str] = {
    "data": "a text file or a folder of text files to train on; unset: the Python standard library's sources",
    "hf": "fine-tune this local transformers MoE model (config, safetensors, tokenizer.json) instead of moeflow's "
    "own: its architecture and tokenizer replace --layers, --model-dim, --tokenizer, ...; a transformers "
    "checkpoint is written to <run-dir>/hf at the end",
    "tokenizer": "bpe (byte-level BPE trained on the training documents) or bytes",
    "vocab_size": "BPE vocabulary size",
    "val_percent": "share of documents held out for validation, by a stable hash of their path",
    "context": "tokens per training sequence (the model's context)",
    "layers": "transformer blocks",
    "heads": "attention heads per block (must divide --model-dim)",
    "model_dim": "model (embedding) dimension",
    "hidden_dim": "hidden size of every expert and dense FFN (MoEConfig's hidden_dim). Was --ffn-hidden",
    "num_experts": "experts per MoE layer",
    "top_k": "experts each token is routed to",
    "moe_every": "an MoE FFN in every N-th block, dense FFNs elsewhere",
    "capacity_factor": f"Tutel's capacity factor in training (> 0 fixed, 0 no drops, < 0 capped no drops); unset: "
    f"{_MOE.capacity_factor:g} (no token dropped)",
    "eval_capacity_factor": "capacity factor at evaluation (0: no token dropped)",
    "aux_loss_weight": f"weight of the load-balancing loss of every MoE layer; unset: {_MOE.aux_loss_weight}, or with "
    f"--hf the model's router_aux_loss_coef if its config sets output_router_logits (else 0); {MODEL_BALANCING} "
    "(with --hf): the model's router_aux_loss_coef",
    "activation": "expert activation: relu, gelu, silu or swiglu",
    "pipeline": "pipeline degree of the MoE layers, or the planner policy auto, model or search",
    "alltoall": "all-to-all algorithm (linear, 2dh, pairwise) or auto",
    "expert_kernel": "the experts' GEMMs: bmm (one batched GEMM over the capacity), loop (one per expert), "
    "ragged (only the filled slots, forward and backward: for dropless routing) or auto (per call the faster "
    "of bmm and ragged for the slots it fills, by rates timed once on the layer's shapes)",
    "token_exchange": "how tokens travel in the expert-parallel all-to-all: padded (every capacity slot), ragged "
    "(only the kept tokens), dedup (the kept tokens, each sent once to a rank however many of its experts the "
    "rank holds) or auto (each chunk ragged where it leaves 10 % of its slots empty, else padded)",
    "wire_dtype": "how the expert-parallel exchange sends tokens and their gradients: exact, bf16 (half the bytes "
    "of an fp32 model) or fp8 (e4m3 with a scale per row); always decoded into the compute dtype",
    "parallel": "expert (split over workers), replicated, adaptive (Tutel's r planned per step), an int r "
    "(0: ZeRO-style data parallel, 1: EP+DP, W/E: EP+MP), or auto; with --mp-size: auto, s1, s2 or ds-baseline",
    "ep_size": "the experts of every MoE layer over this many consecutive workers, those groups data-parallel "
    "copies of each other (expert parallel inside data parallel); unset: over every worker; a multiple of "
    "--mp-size",
    "pp_size": "pipeline parallelism: the blocks in stages over this many groups of workers / pp-size consecutive "
    "workers (pp outermost, then data parallel, then --ep-size); 1: no pipeline. See the pipeline guide",
    "pp_schedule": "with --pp-size: gpipe, 1f1b, interleaved (two stages per worker), zbv or dualpipev (a V: each "
    "worker holds stage r and 2P - 1 - r)",
    "pp_overlap": "with --pp-schedule dualpipev and an expert group in each stage: run each paired forward and "
    "backward side by side, one micro-batch's all-to-alls beside the other's compute (DualPipe's overlap); "
    "--no-pp-overlap runs them one after the other",
    "microbatches": "with --pp-size: micro-batches a step (they divide --batch-size; at least the schedule's stage "
    "count); unset: that count",
    "ranks_per_node": "workers per node, numbered node-major (what 2DH, pairwise, the smart schedule and the "
    "topology gate read); unset: the launcher's LOCAL_WORLD_SIZE, or every worker on one node",
    "mp_size": "tensor-parallel attention over this many consecutive workers, data parallel over the rest; "
    "the MoE layers then run Parm's schedules (--parallel auto, s1, s2 or ds-baseline); with --hf the "
    "attention splits as the model's own tensor-parallel plan does",
    "esp_size": "with --mp-size: hidden shards per expert (Parm's N_ESP; unset: the --mp-size), any divisor of "
    "--ep-size (unset: --workers); the experts split over ep-size / esp-size expert-parallel groups",
    "profile": "a calibrated cluster profile (moeflow calibrate) for the planner",
    "plan": "a plan file written by moeflow plan --out: its settings (a config file and flags win), and its predicted "
    "step time beside the measured one in the run's summary.json",
    "shadowing": "FasterMoE's dynamic shadowing of every MoE layer: off, or auto (each step its cost model picks "
    "hot experts whose weights are broadcast instead of sending their tokens; needs --profile and the "
    "expert-parallel schedule)",
    "topology_gate": "FasterMoE's topology-aware gate on every MoE layer, which limits the tokens sent to other "
    "nodes: off; auto (the share from --profile's bandwidths); or the share itself in [0, 1] (FastMoE: "
    f"{FASTERMOE_REMOTE_SHARE}). Was --gate plain|topology",
    "redundant_experts": "EPLB: this many extra expert slots per MoE layer, holding replicas of the hot experts "
    "(the expert-parallel schedule; experts + this a multiple of --ep-size, unset: --workers)",
    "balance": "fixed (--shadowing and --redundant-experts as set) or auto: at every rebalance each MoE layer "
    "runs the fastest of no balancing, shadowing and its --redundant-experts slots for its recorded load, by the "
    "cost model (needs --profile and --redundant-experts)",
    "rebalance_interval": "with --redundant-experts: place the slots for the recorded load every this many steps",
    "rebalance_window": "with --redundant-experts: the load of this many last steps decides the placement",
    "expert_packing": "Lina's expert packing: off; auto (after --packing-warmup steps, and every --packing-interval "
    "steps, double the experts each worker holds while an expert micro-op is shorter than an all-to-all micro-op); "
    "or N experts per worker from the start. Blocks of experts/N workers then hold every expert, their "
    "all-to-alls stay inside the block, and the copies average their gradients",
    "packing_warmup": "with --expert-packing auto: the step of the first packing decision",
    "packing_interval": "with --expert-packing auto: steps between packing decisions",
    "grad_sync": "how the replicated gradients are all-reduced: after (one call after the backward), overlap "
    "(DDP-style buckets during the backward) or lina (micro-ops during the backward that yield to the MoE "
    "all-to-alls: Lina's scheduler)",
    "microop_mb": "with --grad-sync lina: megabytes per all-reduce micro-op (Lina's tensor partition size)",
    "bucket_mb": "with --grad-sync overlap: megabytes at which a gradient bucket closes (DDP's bucket_cap_mb)",
    "steps": "training steps of the whole run (the learning-rate schedule's length)",
    "stop_at": "end this invocation after this step, with a checkpoint; --resume goes on",
    "batch_size": "sequences per data rank and step (the global batch: this times the data ranks)",
    "lr": f"peak learning rate (AdamW); unset: {SCRATCH_LR[0]}, or with --hf {FINE_TUNING_LR[0]} (transformers' "
    "Trainer's default: a fine-tuning rate)",
    "min_lr": f"learning rate at the end of the cosine decay; unset: {SCRATCH_LR[1]}, with --hf {FINE_TUNING_LR[1]}, "
    f"with --lr that over {FINAL_LR_DIVISOR}",
    "warmup_steps": "steps of linear learning-rate warm-up",
    "weight_decay": "AdamW weight decay of matrices",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "clip the global gradient norm to this (0: off)",
    "max_nonfinite_steps": "stop the job after this many steps in a row whose loss (on any worker) or gradient "
    "was not finite; each such step is skipped on every worker and counted",
    "seed": "seed of the weights and of the data order",
    "dtype": "fp32; bf16 or fp16: activations and GEMMs in that dtype under autocast, fp32 master weights and "
    "routers (fp16 also scales the loss)",
    "workers": "worker processes (one per rank)",
    "backend": "gloo (CPU) or nccl (GPUs)",
    "threads_per_worker": "intra-op threads of each worker",
    "eval_interval": "steps between validation evaluations",
    "eval_windows": "validation windows per evaluation, split over the workers",
    "checkpoint_interval": "steps between checkpoints",
    "keep_checkpoints": "newest checkpoints kept",
    "run_dir": "the run folder; unset: runs/<time>",
    "progress": "show a progress bar",
    "collective_timeout_s": "seconds before a collective that hangs fails the job",
    "tensorboard": "also write TensorBoard event files under <run-dir>/tensorboard: the losses, speed and every MoE "
    "layer's health as scalars, each layer's load per expert as a histogram (needs the tensorboard package: "
    "make setup installs it)",
    "metrics_csv": "also write <run-dir>/metrics.csv: a row per step, a column per figure, for a spreadsheet",
    "alert_collapse_steps": "warn when one expert takes over half of a layer's tokens for this many steps in a row",
    "alert_dead_window": "warn when an expert receives no token for this many steps",
    "alert_dropped_share": "warn when a layer drops more than this share of its assignments in a step",
    "alert_alltoall_share": "warn when the all-to-alls take more than this share of a step",
}
"""What each setting does: the help of its flag (one line each; a test checks every field has one)."""


MODEL_SETTINGS = (
    "context", "layers", "heads", "moe_every", "eval_capacity_factor",  # the architecture's own
    "model_dim", "hidden_dim", "num_experts", "top_k", "capacity_factor", "aux_loss_weight", "activation",
    # the MoE layers' (MoEConfig's names)
    "pipeline", "alltoall", "token_exchange", "wire_dtype", "expert_kernel", "parallel", "shadowing",
    "topology_gate", "redundant_experts", "balance", "esp_size",
)
"""The settings :meth:`TrainConfig.model_config` passes to the model, by name."""


def field_names() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


RENAMED_KEYS = {"ffn_hidden": "hidden_dim"}
"""Old name -> new name of a setting that only changed its name: the old key of a config file or a saved
run, and its flag, still read as the new one (``gate`` changed its values too: :func:`_renamed_gate`)."""


def checked_keys(values: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """``values`` if every key is a TrainConfig field (an old name, ``gate`` or one of
    :data:`RENAMED_KEYS`, is renamed with a warning); else an error naming the key and the closest."""
    values = _renamed_gate(renamed_settings(values, RENAMED_KEYS, source), source)
    names = field_names()
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise ValueError(f"unknown {source} key {key!r}{hint}")
    return dict(values)


def _renamed_gate(values: dict[str, Any], source: str) -> dict[str, Any]:
    """``gate`` (plain | topology) is ``topology_gate`` now: ``gate`` meant the router's kind in
    MoEConfig and this in the trainer. Old configs, checkpoints and flags keep working."""
    if "gate" not in values:
        return values
    old = values.pop("gate")
    require_choice("gate", old, LEGACY_GATES)
    warnings.warn(f"the {source} key 'gate' (--gate) is renamed topology_gate (--topology-gate off|auto|<share>); "
                  f"gate={old!r} reads as the same setting", FutureWarning, stacklevel=3)
    if old == "topology" and "topology_gate" not in values:
        values["topology_gate"] = "auto" if values.get("profile") is not None else FASTERMOE_REMOTE_SHARE
    return values


def parse_config_text(text: str, suffix: str, path: str) -> Any:
    """The file's values by its suffix; a syntax error names the file (the parsers name only a line)."""
    import tomllib

    import yaml

    parsers = {".toml": tomllib.loads, ".yaml": lambda t: yaml.safe_load(t) or {},
               ".yml": lambda t: yaml.safe_load(t) or {}, ".json": json.loads}
    if suffix not in parsers:
        raise ValueError(f"config file {path!r} must end in .toml, .yaml, .yml or .json")
    try:
        return parsers[suffix](text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as error:
        raise ValueError(f"config file {path!r} is not valid {suffix[1:].upper()}: {error}") from None


def load_config_file(path: str) -> dict[str, Any]:
    """Keys and values of a TOML, YAML or JSON file (a ``[train]`` table or the top level)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist; pass an existing .toml, .yaml or .json file")
    values = parse_config_text(file.read_text(), file.suffix.lower(), path)
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r} must hold a table of keys, got {type(values).__name__}")
    if isinstance(values.get("plan"), dict):
        raise ValueError(f"config file {path!r} is a plan written by moeflow plan --out: pass it as --plan {path} "
                         "(its predicted step time then goes into the run's summary.json)")
    if set(values) == {"train"} and isinstance(values["train"], dict):
        values = values["train"]
    return checked_keys(values, source=f"config file {path!r}")
