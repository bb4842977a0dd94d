"""``moeflow bench train``: model FLOPs utilization of the default training run, and the MoE
layers' share of time outside the expert GEMMs.

MFU = model FLOPs per second (6 x active parameters + attention, per token, times tokens/s) over
the machine's matmul throughput, measured in the same worker processes right after training: every
worker multiplies square fp32 matrices at the same time (one intra-op thread each, as in training)
and the peak is the sum of their best rates. Step times are medians after warm-up steps, which
also absorb the planner's online trials.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeflow.comm.collectives import barrier, reduce_values
from moeflow.files import print_json
from moeflow.models.transformer import moe_non_gemm_share
from moeflow.training.config import TrainConfig
from moeflow.training.metrics import iterate_records
from moeflow.training.trainer import Job, train_worker

MFU_TARGET = 0.40
NON_GEMM_TARGET = 0.25
GEMM_SIZES = (512, 1024)


def matmul_rate(seconds: float = 1.0) -> float:
    """Best FLOP/s of square fp32 matmuls on this thread (best over sizes, median over repeats)."""
    best = 0.0
    for size in GEMM_SIZES:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        times = []
        deadline = time.perf_counter() + seconds / len(GEMM_SIZES)
        while time.perf_counter() < deadline or len(times) < 3:
            began = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - began)
        best = max(best, 2 * size**3 / statistics.median(times))
    return best


def _bench_worker(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    summary = train_worker(rank, world_size, job)
    if dist.is_initialized():
        barrier()  # all workers multiply at once: the machine's throughput, not one core's
    rate = matmul_rate()
    rates = reduce_values([rate], None) if dist.is_initialized() else [rate]
    return {**summary, "matmul_flops": rates[0]}


def measure(config: TrainConfig, warmup: int, progress: bool = False) -> dict[str, Any]:
    """Train ``config`` (no evaluation, no checkpoint) and measure its MFU and phases; ``progress``:
    the trainer's bar of its steps (rank 0's, on stderr)."""
    from moeflow.distributed import run_distributed
    from moeflow.training.launch import prepare_job

    with tempfile.TemporaryDirectory(prefix="moeflow-bench-train-") as run_dir:
        job = prepare_job(replace(config, run_dir=run_dir, progress=progress, eval_interval=10**9,
                                  checkpoint_interval=10**9))
        config, corpus = job.config, job.corpus
        result = run_distributed(_bench_worker, config.workers, job, threads_per_worker=config.threads_per_worker,
                                 timeout_s=float("inf"), collective_timeout_s=config.collective_timeout_s)[0]
        records = list(iterate_records(Path(run_dir)))[warmup:]
    if not records:
        raise ValueError(f"--steps {config.steps} leaves no step after --warmup {warmup}")
    model = config.model_config(corpus.vocab_size)
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    model_flops = model.flops_per_token() * tokens_per_s
    phase = {k: statistics.median(r["time_s"][k] for r in records) for k in records[0]["time_s"]}
    moe = phase["routing"] + phase["all_to_all"] + phase["experts"]  # the MoE layers' time
    step_s = statistics.median(r["step_s"] for r in records)
    return {
        "bench": "train", "workers": config.workers, "steps_measured": len(records),
        "tokens_per_step": config.batch_size * config.context * config.workers,
        "active_parameters": model.active_parameters(), "flops_per_token": model.flops_per_token(),
        "tokens_per_s": tokens_per_s, "model_gflops": model_flops / 1e9,
        "matmul_gflops": result["matmul_flops"] / 1e9, "mfu": model_flops / result["matmul_flops"],
        "step_ms": step_s * 1e3, "phase_ms": {k: v * 1e3 for k, v in phase.items()},
        "moe_ms": moe * 1e3, "moe_non_gemm_share": moe_non_gemm_share(phase),
        "pipeline_degrees": [m["pipeline_degree"] for m in records[-1]["moe"]],
        "loss": result["loss"],
    }


def run(config: TrainConfig, warmup: int, progress: bool = False) -> int:
    """Measure, print the run's record, its phases and the targets; ``progress``: a bar of the steps."""
    result = measure(config, warmup, progress)
    print_json({k: v for k, v in result.items() if not isinstance(v, dict)})
    print_json({"bench": "train_phases", **result["phase_ms"]})
    targets = [
        {"target": "mfu >= 0.40", "value": round(result["mfu"], 3), "met": result["mfu"] >= MFU_TARGET},
        {"target": "moe_non_gemm_share <= 0.25", "value": round(result["moe_non_gemm_share"], 3),
         "met": result["moe_non_gemm_share"] <= NON_GEMM_TARGET},
    ]
    print_json({"summary": "train", "targets": targets, "all_targets_met": all(t["met"] for t in targets)})
    return 0
