"""``moeflow generate``: sample from a moeflow checkpoint (its experts over --workers), or ``--hf DIR``: generate
with a local transformers MoE model on N gloo workers (data-parallel attention, expert-parallel MoE)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moeflow.commands import positive_int
from moeflow.files import json_text


def add_parser(commands: Any) -> None:
    generate = commands.add_parser(
        "generate", help="sample text from a moeflow checkpoint, or from a transformers MoE model (--hf)"
    )
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a run folder or one of its checkpoints/step-* folders")
    source.add_argument("--hf", metavar="DIR", help="a local transformers directory (config + safetensors)")
    generate.add_argument("--prompt", default="def ", help="--checkpoint: text to continue (default 'def ')")
    generate.add_argument("--tokens", type=int, default=200, help="--checkpoint: tokens to sample (default 200)")
    generate.add_argument("--top-k", type=int, default=50,
                          help="--checkpoint: sample among the k likeliest tokens (default 50)")
    generate.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default 0.8; --hf: 0, greedy)"
    )
    generate.add_argument("--seed", type=int, default=0, help="random seed of the sampler (default 0)")
    generate.add_argument(
        "--prompts", metavar="FILE",
        help="--hf: one prompt per line, or JSON lines with 'prompt' (text) or 'input_ids' (token ids)",
    )
    generate.add_argument("--workers", type=positive_int, default=1,
                          help="gloo worker processes, the experts spread over them (default 1)")
    generate.add_argument("--max-new-tokens", type=positive_int, default=64,
                          help="--hf: new tokens per prompt (default 64)")
    generate.add_argument("--top-p", type=float, default=1.0,
                          help="--hf: nucleus sampling: sample among the likeliest tokens holding this probability "
                          "mass (default 1: all)")
    generate.add_argument("--batch-size", type=positive_int, default=8,
                          help="--hf: prompts per forward per worker (default 8)")
    generate.add_argument("--dtype", default=None,
                          help="--hf: load the model in this dtype: fp32, bf16, fp16 or torch's names "
                          "(default: as saved)")
    generate.add_argument(
        "--schedule", choices=("static", "lina", "oracle"), default="static",
        help="--hf: where the experts run per batch: static (the expert-parallel placement), lina (estimated from "
        "token paths, re-planned when wrong) or oracle (from the gate's counts); default static",
    )
    generate.add_argument("--routing-profile", metavar="FILE",
                          help="--schedule lina: the routing profile (moeflow profile-routing) to estimate "
                          "with (default: routing_profile.safetensors in the model dir)")
    generate.add_argument("--max-experts-per-rank", type=positive_int, default=4,
                          help="--schedule lina|oracle: most experts one worker computes (default 4, as Lina)")
    generate.add_argument("--replica-slots", type=int, default=None, metavar="R",
                          help="--schedule lina|oracle: a memory budget: each worker keeps its own experts and "
                          "computes at most R copies of others (default: Lina's packing up to "
                          "--max-experts-per-rank)")
    generate.add_argument("--cluster-profile", metavar="FILE",
                          help="--replica-slots: a calibrated profile of the cluster (moeflow calibrate); a copy is "
                          "then made only where its cost model says it pays (default: wherever it unloads the "
                          "busiest worker)")
    generate.add_argument("--schedule-log", metavar="FILE",
                          help="--schedule lina|oracle: write per-batch plans, estimate accuracy and phase-2 rate "
                          "to this JSON lines file")
    generate.add_argument("--health", metavar="FILE",
                          help="write the MoE layers' health (load per expert, drops, the router's entropy, bytes "
                          "sent) as JSON lines: over the whole generation with --checkpoint, per round of batches "
                          "with --hf")
    generate.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    try:
        if args.hf is not None:
            return _run_hf(args)
        from moeflow.training.generate import generate_text

        if args.schedule != "static":
            raise ValueError("--schedule plans where the experts run per batch, which is --hf generation; "
                             "--checkpoint keeps the expert-parallel placement")
        temperature = 0.8 if args.temperature is None else args.temperature
        print(generate_text(args.checkpoint, args.prompt, args.tokens, temperature, args.top_k, args.seed,
                            args.workers, health_path=None if args.health is None else Path(args.health)))
        return 0
    except (FileNotFoundError, ValueError) as error:
        print(f"moeflow generate: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a worker's bad input (WorkerError): its exception's own line
        from moeflow.distributed import WorkerError

        lines = str(error).strip().splitlines()
        if not isinstance(error, WorkerError) or not lines[-1].startswith(("ValueError: ", "FileNotFoundError: ")):
            raise
        print(f"moeflow generate: error: {lines[-1].split(': ', 1)[1]}", file=sys.stderr)
        return 2


def read_prompts(path: str) -> list[dict[str, Any]]:
    """Prompts as dicts with 'prompt' and/or 'input_ids'."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts {path!r} holds no prompt")
    if path.endswith(".jsonl"):
        prompts = [json.loads(line) for line in lines]
        for number, prompt in enumerate(prompts, 1):
            if not isinstance(prompt, dict) or not ({"prompt", "input_ids"} & prompt.keys()):
                raise ValueError(f"--prompts {path!r} line {number}: a JSON object with 'prompt' or 'input_ids'")
        return prompts
    return [{"prompt": line} for line in lines]


def _run_hf(args: argparse.Namespace) -> int:
    from moeflow.hf.loading import check_model_dir
    from moeflow.hf.serving import generate_hf

    check_model_dir(args.hf)
    if args.prompts is None:
        raise ValueError("--hf needs --prompts FILE")
    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts!r} is not a file")
    schedule = _schedule(args)
    records, log = generate_hf(
        args.hf, read_prompts(args.prompts), args.workers, args.batch_size, args.dtype, schedule,
        health_path=args.health, max_new_tokens=args.max_new_tokens, temperature=args.temperature or 0.0,
        top_p=args.top_p, seed=args.seed,
    )
    for record in records:
        print(json_text(record), flush=True)
    if args.schedule_log is not None:
        Path(args.schedule_log).write_text("".join(json.dumps(entry) + "\n" for entry in log))
    return 0


def _schedule(args: argparse.Namespace) -> Any:
    """The --schedule settings and profile path (None: static)."""
    if args.schedule == "static":
        return None
    from moeflow.hf.serving import ScheduleRequest
    from moeflow.inference import PROFILE_FILE, RoutingProfile, SchedulerSettings

    settings = SchedulerSettings(args.schedule, max_experts_per_rank=args.max_experts_per_rank,
                                 replica_slots=args.replica_slots)
    cluster = args.cluster_profile
    if cluster is not None:
        from moeflow.perf import ClusterProfile

        if args.replica_slots is None:
            raise ValueError("--cluster-profile prices the copies of a memory budget: give --replica-slots R too")
        ClusterProfile.load(cluster)  # a missing or malformed file fails here, before the workers start
    if args.schedule != "lina":
        return ScheduleRequest(settings, cluster_profile_path=cluster)
    profile = args.routing_profile or str(Path(args.hf) / PROFILE_FILE)
    RoutingProfile.load(profile)  # a missing or foreign file fails here, before the workers start
    return ScheduleRequest(settings, profile, cluster)
