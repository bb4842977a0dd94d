"""``moeflow bench hf-ep``: transformers' own expert parallelism against moeflow's backend inside it.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench.hf_ep`, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, fail, positive_int
from moeflow.commands.bench.common import add_cluster_layout, run_cluster_grid
from moeflow.config import ALLTOALL_ALGORITHMS, HF_EP_TOKEN_EXCHANGES


def add(benches: Any) -> None:
    hf_ep = benches.add_parser(
        "hf-ep", help="transformers' expert parallelism (all_to_all) against ep_implementation='moeflow' and "
        "train --hf's model",
        description="A Qwen3-MoE-like model of random weights loaded with transformers' DistributedConfig("
        "fsdp_size=W, ep_size=W) once per ep_implementation (all_to_all and moeflow, its defaults), and as "
        "moeflow train --hf loads it (the blocks on moeflow's layer, the dense part data parallel), each rank its "
        "own batch: the logits checked equal, then training steps with AdamW, prefill and decode, round-robin, the "
        "slowest rank's medians. On local workers over loopback (--workers), or on the emulated cluster "
        "(--cluster, needs root).",
    )
    hf_ep.add_argument("--workers", type=positive_int, default=2, help="local gloo workers (default 2)")
    hf_ep.add_argument("--cluster", action="store_true", help="on the emulated cluster (--nodes x --ranks-per-node)")
    add_cluster_layout(hf_ep, ranks_per_node=1)
    hf_ep.add_argument("--num-experts", type=positive_int, default=16,
                       help="number of experts E in each MoE layer (default 16)")
    hf_ep.add_argument("--top-k", type=positive_int, default=4, help="experts per token k (default 4)")
    hf_ep.add_argument("--hidden-size", type=positive_int, default=256, help="model hidden size (default 256)")
    hf_ep.add_argument("--moe-hidden", type=positive_int, default=256, help="expert hidden size (default 256)")
    hf_ep.add_argument("--layers", type=positive_int, default=2, help="MoE decoder layers (default 2)")
    hf_ep.add_argument("--batch", type=positive_int, default=4, help="sequences per rank (default 4)")
    hf_ep.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence (default 128)")
    hf_ep.add_argument("--repeats", type=positive_int, default=5, help="timed steps per implementation (default 5)")
    hf_ep.add_argument("--token-exchange", choices=HF_EP_TOKEN_EXCHANGES, default="auto",
                       help="what moeflow's backend sends (moeflow.hf.configure; default auto)")
    hf_ep.add_argument("--alltoall", choices=ALLTOALL_ALGORITHMS, default="linear",
                       help="moeflow's all-to-all (2dh and pairwise read the cluster's nodes; default linear)")
    hf_ep.add_argument("--pipeline", type=_chunks, default="auto",
                       help="the chunks moeflow's backend moves and computes a block's rows in, or auto: each "
                            "block searches its degree per batch size (default auto)")
    add_progress_flag(hf_ep)
    hf_ep.set_defaults(func=run_hf_ep)


def _chunks(text: str) -> int | str:
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"give auto or a number of chunks >= 1, got {text!r}")


def run_hf_ep(args: argparse.Namespace) -> int:
    from moeflow.bench.hf_ep import HFEPPoint, run_cluster, run_loopback, summarize
    from moeflow.files import print_json

    ranks = args.nodes * args.ranks_per_node if args.cluster else args.workers
    if ranks < 2 or args.num_experts % ranks:
        raise fail("bench hf-ep", f"{ranks} ranks: expert parallelism needs at least 2 ranks that divide "
                   f"--num-experts {args.num_experts}; change --workers (or --nodes/--ranks-per-node) or --num-experts")
    if args.top_k > args.num_experts:
        raise fail("bench hf-ep", f"--top-k {args.top_k} exceeds --num-experts {args.num_experts}")
    if args.hidden_size % 4:
        raise fail("bench hf-ep", f"--hidden-size {args.hidden_size}: give a multiple of 4 (the model's 4 heads)")
    point = HFEPPoint(args.num_experts, args.top_k, args.hidden_size, args.moe_hidden, args.layers, args.batch,
                      args.seq, token_exchange=args.token_exchange, alltoall=args.alltoall, pipeline=args.pipeline)
    if args.cluster:
        return run_cluster_grid("bench hf-ep", run_cluster, summarize, [point], args)
    print_json(summarize(run_loopback([point], args.workers, args.repeats, print_json)))
    return 0
