"""``moeflow bench memory``: memory per worker against its share.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, show_progress


def add(benches: Any) -> None:
    from moeflow.bench.memory_accounting import SCENARIOS  # no torch at import

    memory = benches.add_parser(
        "memory", help="each worker's peak resident memory against the memory it must hold, for generation and "
        "for training with a checkpoint save and resume (generation needs the hf extra)",
        description="Per worker: the peak resident memory minus that of a process that only imports torch, "
        "transformers and moeflow, over its share (the non-expert parameters plus this rank's experts; in training "
        "16 bytes per such parameter plus one batch's activations). generation: moeflow generate --hf's workers on a "
        "random Mixtral-like model saved with save_pretrained. scheduled-generation: the same with Lina's per-batch "
        "expert placement (the oracle popularity; a worker fetches the experts it computes but does not store). "
        "training: moeflow train's workers for --steps steps "
        "and a checkpoint, then a resume from it for --steps more. sharded-experts: a user's own loop (AdamW, "
        "--layers residual MoE layers) on a (dp, ep) mesh of EP = workers / 2 x DP = 2, wrapped by "
        "expert_fully_shard with the experts FSDP2-sharded over dp; whole-experts: the same with the experts whole "
        "(the reference). Each record also gives the peak of a process that "
        "imports every module the workers loaded (imports_bytes: the code's own part of the peak) and the ratio above "
        "it.",
    )
    memory.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                        help=f"what to measure (default all: {' '.join(SCENARIOS)})")
    memory.add_argument("--workers", type=positive_int, nargs="+", default=[1, 2, 4],
                        help="gloo worker counts to measure, each must divide --num-experts (default 1 2 4)")
    memory.add_argument("--layers", type=positive_int, default=4,
                        help="decoder layers, each with an MoE block (default 4)")
    memory.add_argument("--model-dim", type=positive_int, default=512,
                        help="model dimension M, a multiple of the 4 attention heads (default 512)")
    memory.add_argument("--hidden-dim", type=positive_int, default=2048, help="expert hidden size H (default 2048)")
    memory.add_argument("--num-experts", type=positive_int, default=8, help="number of experts E (default 8)")
    memory.add_argument("--steps", type=positive_int, default=3,
                        help="training steps before the checkpoint, and again after the resume (default 3)")
    memory.add_argument("--data", default=None,
                        help="training: a folder or file of text to train on (default: the trainer's, Python's "
                        "standard library)")
    memory.add_argument("--vocab-size", type=positive_int, default=4096,
                        help="training: the tokenizer's vocabulary size (default 4096)")
    memory.add_argument("--skip-imports", action="store_true",
                        help="skip the process that imports what the workers loaded (the code's own share of the "
                        "peak), which takes a few seconds per scenario")
    add_progress_flag(memory)
    memory.set_defaults(func=run_memory)


def run_memory(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    from moeflow.bench.memory import HEADS, MemoryBenchConfig, is_generation, run, training_config
    from moeflow.bench.memory_layouts import LAYOUT_SCENARIOS, check_layout
    from moeflow.progress import progress_bar

    uneven = [w for w in args.workers if args.num_experts % w]
    if uneven:
        raise fail("bench memory", f"--num-experts {args.num_experts} is not divisible by --workers {uneven}: the "
                   "experts are split evenly over the workers")
    for workers in args.workers if any(s in LAYOUT_SCENARIOS for s in args.scenarios) else ():
        try:
            check_layout(workers, args.num_experts)
        except ValueError as error:
            raise fail("bench memory", error) from None
    if args.model_dim % HEADS:
        raise fail("bench memory", f"--model-dim {args.model_dim} must be a multiple of the {HEADS} attention heads")
    if args.num_experts < 2:
        raise fail("bench memory", "--num-experts must be at least 2 (the models route each token to 2 experts)")
    if any(is_generation(s) for s in args.scenarios) and importlib.util.find_spec("transformers") is None:
        raise fail("bench memory", "the generation scenario needs transformers: pip install 'moeflow[hf]', or "
                   "--scenarios training")
    config = MemoryBenchConfig(
        scenarios=tuple(dict.fromkeys(args.scenarios)), workers=tuple(dict.fromkeys(args.workers)),
        layers=args.layers, model_dim=args.model_dim, hidden_dim=args.hidden_dim, num_experts=args.num_experts,
        steps=args.steps, data=args.data, vocab_size=args.vocab_size, imports=not args.skip_imports,
    )
    try:
        if "training" in config.scenarios:  # the trainer's own checks, before anything runs
            for workers in config.workers:
                training_config(config, workers, Path("unused"))
        with progress_bar("bench memory", "measurement", enabled=show_progress(args)) as progress:
            return run(config, progress)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        raise fail("bench memory", error) from None
