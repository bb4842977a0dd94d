"""A plan file: what ``moeflow plan --out`` writes and ``moeflow train --plan`` runs.

Its top level is ``moeflow train``'s own settings: the model's shape, the workers, and the layout and
schedule the joint planner chose. Its ``[plan]`` table says what the simulator predicted, which
settings the plan fixes and what stays adaptive at run time, and the runner-up. A run of it copies
that table into its folder (``plan.json``), and its ``summary.json`` puts the measured step time
beside the prediction.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeflow.perf.sim.cluster import Cluster
    from moeflow.perf.sim.plan import StepPlan
    from moeflow.perf.sim.workload import ModelSpec
    from moeflow.sim.step import StepResult
    from moeflow.training.config import TrainConfig

PLAN_TABLE = "plan"
"""The table of a plan file that holds the prediction, not settings."""
RUN_RECORD = "plan.json"
"""The plan's table, copied into the folder of a run of it."""
ADAPTIVE = MappingProxyType({
    "capacity": "each expert's capacity follows the step's routing (Tutel's dynamic capacity)",
    "shadowing": "which experts are shadowed is FasterMoE's Algorithm 1's choice per step, from the step's load",
    "redundant_experts": "the slots are placed for the recorded load every rebalance_interval steps (EPLB)",
})
"""What a plan leaves to run time, by the setting that turns it on ("capacity" always)."""
PLAN_OWNED = ("workers", "ranks_per_node", "ep_size", "mp_size", "esp_size", "parallel", "pipeline", "alltoall",
              "token_exchange", "wire_dtype", "shadowing", "topology_gate", "redundant_experts", "balance",
              "expert_packing", "grad_sync", "bucket_mb", "microop_mb", "pp_size", "pp_schedule", "microbatches",
              "pp_overlap")
"""The settings a plan decides: a base config's values of them are dropped, so the run is the plan's
layout and schedule (an unset one takes ``moeflow train``'s default)."""


def model_of_config(config: TrainConfig) -> ModelSpec:
    """The simulator's model of ``moeflow train``'s model under ``config``: every block an MoE layer
    (the simulator's model has no dense FFN blocks), its tokens per worker, dtype and vocabulary."""
    from moeflow.config import LayerDims, ffn_projections
    from moeflow.perf.sim.workload import ModelSpec

    if config.moe_every != 1:
        raise ValueError(f"moe_every={config.moe_every}: the planner's simulator makes every block an MoE layer; "
                         "plan a config with moe_every = 1")
    moe = config.model_config(config.vocab_size).moe
    dims = LayerDims(config.model_dim, config.hidden_dim, config.num_experts, config.top_k,
                     ffn_projections(config.activation), bias=moe.bias)
    return ModelSpec("config", config.layers, dims, moe.capacity_factor, config.batch_size * config.context,
                     config.context, config.dtype, vocab_size=config.vocab_size)


def settings_of_model(model: ModelSpec) -> dict[str, Any]:
    """``moeflow train``'s settings for a simulator model file's shape (``moeflow plan --model``)."""
    if model.tokens_per_rank % model.sequence_length:
        raise ValueError(f"model {model.name}: tokens_per_rank ({model.tokens_per_rank}) must be a multiple of "
                         f"sequence_length ({model.sequence_length}) to become a batch of sequences")
    dims = model.dims
    return {"layers": model.layers, "model_dim": dims.model_dim, "hidden_dim": dims.hidden_dim,
            "num_experts": dims.num_experts, "top_k": dims.top_k,
            **({"activation": "swiglu"} if dims.projections == 3 else {}),
            "capacity_factor": model.capacity_factor, "context": model.sequence_length,
            "batch_size": model.tokens_per_rank // model.sequence_length, "dtype": model.dtype,
            **({"vocab_size": model.vocab_size} if model.vocab_size else {})}


def plan_settings(plan: StepPlan, cluster: Cluster, model: ModelSpec | None = None) -> dict[str, Any]:
    """``moeflow train``'s settings that run ``plan`` on ``cluster``: the workers and their layout,
    the schedule (its record's settings) and the options every schedule shares. A pipelined plan
    also sets ``batch_size`` from ``model``: the same global batch on its world / pp data ranks."""
    from moeflow.config import GRADIENT_BUCKET_MB
    from moeflow.sim.pipelined import data_rank_sequences
    from moeflow.sim.step import technique_of

    settings: dict[str, Any] = {"workers": cluster.world_size, "ranks_per_node": cluster.gpus_per_node}
    if plan.ep is not None and plan.ep != cluster.world_size // plan.pp:
        settings["ep_size"] = plan.ep
    settings.update(technique_of(plan).simulated.settings(plan))
    settings["token_exchange"] = "dedup" if plan.dedup_top_k is not None else "ragged" if plan.ragged_exchange \
        else "padded"
    settings["wire_dtype"] = plan.wire_dtype
    settings["shadowing"] = "auto" if plan.shadowed else "off"
    settings["redundant_experts"] = plan.redundant_slots
    settings["balance"] = "fixed"
    settings["expert_packing"] = "off"
    if plan.prioritize_alltoall:
        settings["grad_sync"] = "lina"
    elif plan.bucket_mb == math.inf:
        settings["grad_sync"] = "after"
    else:  # DDP's buckets; a plan of one all-reduce per layer (bucket 0) runs as the trainer's default buckets
        settings.update(grad_sync="overlap", bucket_mb=plan.bucket_mb or GRADIENT_BUCKET_MB)
    settings["pp_size"] = plan.pp
    if plan.pp > 1:
        if model is None:
            raise ValueError("a pipelined plan's settings need the model: its batch_size keeps the global batch")
        settings.update(pp_schedule=plan.pp_schedule, microbatches=plan.pipeline_microbatches,
                        pp_overlap=plan.pp_overlap,
                        batch_size=data_rank_sequences(model, plan.pp))
    return settings


def pipeline_blockers(base: dict[str, Any]) -> list[str]:
    """The settings of ``base`` (a plan's starting config) that keep ``moeflow train`` from running
    any pipelined plan and that a plan does not decide (``--dtype bf16``, ``--hf``): the joint
    planner then searches no pipeline. A calibrated profile is not one: a pipelined plan drops it."""
    from moeflow.training.pipeline_settings import NOT_WITH_PIPELINE

    return [f"{key}={base[key]!r}" for key, value in NOT_WITH_PIPELINE.items()
            if key not in PLAN_OWNED and key != "profile" and key in base and base[key] != value]


def plan_table(results: list[StepResult], cluster: Cluster, model: ModelSpec, fixed: dict[str, Any],
               training: bool = True) -> dict[str, Any]:
    """The ``[plan]`` table: the top plan's label and predicted step time, what it fixes and what
    stays adaptive, and the runner-up."""
    from moeflow.sim.step import plan_label

    best = results[0]
    adaptive = [ADAPTIVE["capacity"]] + [ADAPTIVE[key] for key in ("shadowing", "redundant_experts")
                                         if fixed.get(key) not in (None, "off", 0)]
    table: dict[str, Any] = {
        "label": plan_label(best.plan), "predicted_step_ms": round(best.step_s * 1e3, 4),
        "cluster": cluster.name, "ranks": cluster.world_size, "model": model.name,
        "what": "training step" if training else "inference batch",
        "expert_weights_mb_per_rank": round(expert_weight_bytes(best.plan, cluster, model) / 1e6, 3),
        "fixed": sorted(fixed), "adaptive": adaptive,
    }
    if len(results) > 1:
        table["runner_up"] = {"label": plan_label(results[1].plan),
                              "predicted_step_ms": round(results[1].step_s * 1e3, 4)}
    return table


def expert_weight_bytes(plan: StepPlan, cluster: Cluster, model: ModelSpec) -> float:
    """Bytes of expert weights one rank holds under ``plan``: every expert under a replicating
    schedule, else its expert group's share (a smaller group holds more per rank)."""
    from moeflow.sim.pipelined import blocks_per_rank
    from moeflow.sim.step import technique_of

    dims = model.dims
    holders = 1 if technique_of(plan).replicates_experts else (plan.ep or cluster.world_size // plan.pp)
    return blocks_per_rank(model.layers, plan) * dims.num_experts / holders * dims.expert_parameters * \
        model.element_bytes


def write_plan(path: Path, results: list[StepResult], cluster: Cluster, model: ModelSpec, base: dict[str, Any],
               profile: str | None, training: bool = True) -> dict[str, Any]:
    """Write the fastest of ``results`` (ranked plans) whose settings ``moeflow train`` accepts, on
    top of ``base`` settings, as a plan file at ``path``; return its ``[plan]`` table. A plan
    ``moeflow train`` refuses is skipped, and the file's header says why."""
    from moeflow.sim import plan_label

    results, refused = list(results), []
    while results:
        owned = {key: value for key, value in base.items() if key not in PLAN_OWNED}
        settings = {**owned, **plan_settings(results[0].plan, cluster, model),
                    **({"profile": profile} if profile else {})}
        if results[0].plan.pp > 1:  # the pipelined trainer takes no profile (it plans nothing at run time)
            settings.pop("profile", None)
        problem = train_refusal(settings)
        if problem is None:
            break
        refused.append(f"{plan_label(results.pop(0).plan)}: {problem}")
    if not results:
        raise ValueError("moeflow train accepts none of the top plans: " + "; ".join(refused))
    table = plan_table(results, cluster, model, plan_settings(results[0].plan, cluster, model), training)
    header = (f"moeflow plan: {table['label']} on {cluster.name} ({cluster.world_size} ranks), model {model.name}.\n"
              f"Run it with: moeflow train --plan {path}")
    if refused:
        header += "\nSkipped, moeflow train refuses them: " + "; ".join(refused)
    if settings.get("shadowing") == "auto" and "profile" not in settings:
        header += ("\nshadowing = auto decides with a calibrated profile of this cluster: run moeflow calibrate "
                   "there and add profile = \"<its JSON>\" (or --profile)")
    write_plan_file(path, settings, table, header)
    return table


def train_refusal(settings: dict[str, Any]) -> str | None:
    """Why ``moeflow train`` refuses ``settings``, or None. A missing calibrated profile is not a
    refusal: the plan file says to add one."""
    from moeflow.training.config import TrainConfig

    placeholder = {"profile": "<calibrated profile>"} if settings.get("pp_size", 1) == 1 else {}
    try:
        TrainConfig(**{**placeholder, **settings})
    except ValueError as error:
        return str(error)
    return None


def write_plan_file(path: Path, settings: dict[str, Any], table: dict[str, Any], header: str) -> None:
    """``settings`` at the top level and ``table`` as ``[plan]``, in TOML, after ``header`` (comments)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"{key} = {_toml_value(value)}" for key, value in settings.items() if value is not None]
    lines += ["", f"[{PLAN_TABLE}]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in table.items() if not isinstance(value, dict)]
    for key, value in table.items():
        if isinstance(value, dict):
            lines += ["", f"[{PLAN_TABLE}.{key}]", *(f"{k} = {_toml_value(v)}" for k, v in value.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(path)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"a plan file holds finite numbers, got {value!r}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string (TOML has no surrogate escapes)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"a plan file cannot hold {type(value).__name__} values ({value!r})")


def read_plan_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plan file's settings and its ``[plan]`` table; a clear error for a file that is not one."""
    from moeflow.training.config import checked_keys, parse_config_text

    if not Path(path).is_file():
        raise FileNotFoundError(f"plan file {path!r} does not exist; write one with moeflow plan --out {path}")
    values = parse_config_text(Path(path).read_text(), Path(path).suffix, path)
    table = values.pop(PLAN_TABLE, None) if isinstance(values, dict) else None
    if not isinstance(table, dict) or "predicted_step_ms" not in table:
        raise ValueError(f"plan file {path!r} has no [plan] table with predicted_step_ms: write it with moeflow plan "
                         "--out, or pass a config file of settings with --config")
    return checked_keys(values, source=f"plan file {path!r}"), table


def run_record(config: TrainConfig) -> dict[str, Any]:
    """The ``[plan]`` table of ``config.plan`` for the run's folder, with the settings the plan fixes
    that this run changed (a flag, a config file or the API), so the comparison says what ran."""
    assert config.plan is not None
    settings, table = read_plan_file(config.plan)
    changed = {key: {"plan": settings.get(key), "run": getattr(config, key)} for key in table.get("fixed", [])
               if settings.get(key) != getattr(config, key, None)}
    return {**table, **({"overridden": changed} if changed else {})}


def measured_against_plan(run_dir: Path, steady: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The plan's prediction beside the median time of the run's ``steady`` steps (the report's: not
    the warm-up, not the planner's trials), or None for a run that was not started from a plan."""
    path = run_dir / RUN_RECORD
    if not path.exists() or not steady:
        return None
    table = json.loads(path.read_text())
    steps = [r["step_s"] for r in steady if "step_s" in r]
    if not steps:
        return None
    measured = statistics.median(steps) * 1e3
    predicted = float(table["predicted_step_ms"])
    return {"label": table.get("label"), "predicted_step_ms": predicted, "measured_step_ms": round(measured, 4),
            "error_percent": round((predicted - measured) / measured * 100, 2), "steps_measured": len(steps),
            **({"overridden": table["overridden"]} if "overridden" in table else {})}

