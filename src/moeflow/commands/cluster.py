"""``moeflow launch`` (run a command as every rank of an emulated cluster) and ``moeflow cluster``
(build one, probe its links, tear it down)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moeflow.commands import fail, positive_int, require_testbed


def add_parser(commands: Any) -> None:
    launch = commands.add_parser(
        "launch", help="run a command as every rank of an emulated multi-node cluster (needs root)",
        description="Example: moeflow launch --nodes 2 --ranks-per-node 2 --inter-gbit 1 -- "
        "python -m moeflow bench layer",
    )
    _add_cluster_arguments(launch)
    launch.add_argument("rank_command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    launch.set_defaults(func=run_launch)
    cluster = commands.add_parser(
        "cluster", help="create an emulated cluster, probe its links, print JSON, tear it down (needs root)"
    )
    _add_cluster_arguments(cluster)
    cluster.add_argument("--cleanup", action="store_true",
                         help="only delete the network namespaces that killed runs left behind")
    cluster.set_defaults(func=run_cluster)


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=positive_int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=2, help="ranks on each node (default 2)")
    parser.add_argument("--inter-gbit", type=float, default=1.0,
                        help="inter-node bandwidth per node, Gbit/s (default 1)")
    parser.add_argument("--inter-latency-us", type=float, default=0.0,
                        help="one-way inter-node latency in microseconds (needs the kernel's sch_netem; default 0)")
    parser.add_argument("--inter-jitter-us", type=float, default=0.0,
                        help="latency jitter in microseconds (needs sch_netem; default 0)")
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port of rank 0 (default 29500)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop every rank after this many seconds (default: no limit)")


def _cluster_spec(args: argparse.Namespace) -> Any:
    from moeflow.testbed import ClusterSpec

    try:
        return ClusterSpec(args.nodes, args.ranks_per_node, args.inter_gbit, args.inter_latency_us,
                           args.inter_jitter_us)
    except ValueError as error:
        raise fail(args.command, error) from None


def run_launch(args: argparse.Namespace) -> int:
    from moeflow.testbed import ClusterError, launch

    command = args.rank_command[1:] if args.rank_command[:1] == ["--"] else args.rank_command
    if not command:
        raise fail("launch", "give the command to run after --, e.g. -- python train.py")
    try:
        return launch(_cluster_spec(args), command, master_port=args.master_port, timeout_s=args.timeout)
    except ClusterError as error:
        raise fail("launch", error) from None


def run_cluster(args: argparse.Namespace) -> int:
    from moeflow.testbed import ClusterError, launch

    if args.cleanup:
        return _cleanup()
    try:
        return launch(_cluster_spec(args), [sys.executable, "-m", "moeflow.testbed.probe"],
                      master_port=args.master_port, timeout_s=args.timeout or 120)
    except ClusterError as error:
        raise fail("cluster", error) from None


def _cleanup() -> int:
    import subprocess

    from moeflow.testbed import stale_namespaces

    require_testbed("cluster")
    stale = stale_namespaces()
    for name in stale:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)
    print(f"deleted {len(stale)} stale namespace(s): {' '.join(stale) or '-'}")
    return 0
