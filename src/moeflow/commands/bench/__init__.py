"""``moeflow bench layer | kernels | overlap | alltoall | pipeline | schedules | parallel | skew | exchange |
contention | train | generate | lina-inference | simulator | papers | plan | memory | faults | wire | dedup |
hf-ep | monitor``: each
prints one JSON object per measurement and a summary line. Each benchmark owns its parser, in the module of its name."""

from __future__ import annotations

from typing import Any

from moeflow.commands.bench import (
    alltoall,
    contention,
    dedup,
    exchange,
    faults,
    generate,
    hf_ep,
    kernels,
    layer,
    lina_inference,
    memory,
    monitor,
    overlap,
    papers,
    parallel,
    pipeline,
    plan,
    schedules,
    simulator,
    skew,
    stages,
    train,
    wire,
)

BENCHES = (layer, kernels, overlap, alltoall, pipeline, stages, schedules, parallel, skew, exchange, contention, train,
            generate, lina_inference, simulator, papers, plan, memory, faults, wire, dedup, hf_ep, monitor)
"""Every benchmark, in the order ``moeflow bench --help`` lists them."""


def add_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark (prints JSON lines and a summary)")
    benches = bench.add_subparsers(dest="bench", required=True)
    for module in BENCHES:
        module.add(benches)
