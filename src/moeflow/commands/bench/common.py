"""What several ``moeflow bench`` parsers share: the emulated cluster's layout, the device, a routed
layer's shape, and running a grid of points on the cluster."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import fail, positive_int, require_testbed, show_progress


def add_cluster_layout(parser: argparse.ArgumentParser, ranks_per_node: int) -> None:
    parser.add_argument("--nodes", type=positive_int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=ranks_per_node,
                        help=f"ranks on each node (default {ranks_per_node})")
    parser.add_argument("--inter-gbit", type=float, default=1.0, help="bandwidth between nodes, Gbit/s (default 1)")
    parser.add_argument("--profile", default=None, help="a profile of this cluster (skips calibration)")


def device_for(name: str, command: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise fail(command, f"--device {name!r} is not a device; use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise fail(command, f"--device {name} needs a CUDA GPU and this machine has none; use --device cpu")
    return device


def add_routed_layer(
    parser: argparse.ArgumentParser, num_experts: int, model_dim: int, top_k: int, experts_note: str = ""
) -> None:
    """The shape of the one layer the routing benchmarks pin (E, H, M, tokens per rank, k)."""
    parser.add_argument("--num-experts", type=positive_int, default=num_experts,
                        help=f"number of experts E (default {num_experts}{experts_note})")
    parser.add_argument("--hidden-dim", type=positive_int, default=1024, help="expert hidden size H (default 1024)")
    parser.add_argument("--model-dim", type=positive_int, default=model_dim,
                        help=f"model dimension M (default {model_dim})")
    parser.add_argument("--tokens", type=positive_int, default=2048, help="tokens per rank (default 2048)")
    parser.add_argument("--top-k", type=positive_int, default=top_k,
                        help=f"experts each token is routed to (default {top_k})")


def pipeline_choice(text: str) -> int | str:
    """A ``pipeline`` setting from the command line: a policy name or a degree."""
    from moeflow.config import validate_pipeline

    try:
        return validate_pipeline(int(text) if text.isdigit() else text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run_cluster_grid(command: str, run: Any, summarize: Any, grid: list[Any], args: argparse.Namespace) -> int:
    """Launch the emulated cluster for a grid benchmark (a bar of its points on a terminal) and print
    its summary."""
    from moeflow.files import print_json
    from moeflow.progress import progress_bar
    from moeflow.testbed import ClusterError

    require_testbed(command)
    try:
        with progress_bar(command, "point", enabled=show_progress(args)) as progress:
            records = run(grid, args.nodes, args.ranks_per_node, args.inter_gbit, args.repeats, args.profile,
                          progress=progress)
    except (ClusterError, RuntimeError) as error:
        raise fail(command, error) from None
    print_json(summarize(records))
    return 0
