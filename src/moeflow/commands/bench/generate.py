"""``moeflow bench generate``: generation against transformers' experts.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int, require_testbed, show_progress


def add(benches: Any) -> None:
    generate = benches.add_parser(
        "generate", help="prefill and decode of transformers MoE models: moeflow vs transformers' experts (needs "
        "the hf extra; --workers 2 runs on an emulated cluster, needs root)",
        description="Random-weight Mixtral-like (E=8, k=2) and Qwen3-MoE-like (E=64, k=8) models generate greedily "
        "with a KV cache; moeflow and transformers' eager and grouped_mm experts take turns on the same weights. "
        "--workers 2: expert parallel on the emulated 2x1 cluster, the all-to-all share of a decode step at "
        "pipeline degrees 1 and 2.",
    )
    generate.add_argument("--models", nargs="+", default=["mixtral", "qwen3"], choices=("mixtral", "qwen3"),
                          help="Mixtral-like (E=8, k=2) and/or Qwen3-MoE-like (E=64, k=8) (default both)")
    generate.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 8, 32],
                          help="batch sizes to time, sequences per worker (default 1 8 32)")
    generate.add_argument("--prompt-tokens", type=positive_int, default=32, help="prompt length in tokens (default 32)")
    generate.add_argument("--new-tokens", type=positive_int, default=16,
                          help="tokens generated per sequence (default 16)")
    generate.add_argument("--repeats", type=positive_int, default=3, help="timed generations each (default 3)")
    generate.add_argument("--workers", type=positive_int, default=1, choices=(1, 2),
                          help="processes: 1 runs here; 2 runs expert parallel on the emulated 2x1 cluster (default 1)")
    generate.add_argument("--inter-gbit", type=float, default=1.0,
                          help="--workers 2: bandwidth between nodes, Gbit/s (default 1)")
    add_progress_flag(generate)
    generate.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from moeflow.bench.generate import GeneratePoint, measure_point, read_bandwidth, run_cluster, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar

    if args.new_tokens < 2:
        raise fail("bench generate", f"--new-tokens {args.new_tokens} leaves no decode step to time; use 2 or more")
    grid = [GeneratePoint(model, batch, args.prompt_tokens, args.new_tokens)
            for model in args.models for batch in args.batch_sizes]
    if args.workers == 2:
        require_testbed("bench generate")
        from moeflow.testbed import ClusterError

        try:
            with progress_bar("bench generate", "point", enabled=show_progress(args)) as progress:
                records = run_cluster(grid, 2, 1, args.inter_gbit, args.repeats, progress=progress)
        except (ClusterError, RuntimeError) as error:
            raise fail("bench generate", error) from None
        share = [r["alltoall_share"] for r in records]
        print_json({"summary": "generate-expert-parallel", "records": len(records),
                    "max_alltoall_share": max(share) if share else None})
        return 0
    torch.set_num_threads(1)
    bandwidth = read_bandwidth()
    records = []
    with progress_bar("bench generate", "point", len(grid), enabled=show_progress(args)) as progress:
        for point in grid:
            for record in measure_point(point, args.repeats, bandwidth):
                print_json(record)
                records.append(record)
            progress.advance()
    print_json(summarize(records))
    return 0
