"""Trace one default training forward of one MoE layer on one process: which moeflow modules it
runs through and how often it crosses between the layer's package and the techniques' package.

    python scripts/trace_forward.py            # one JSON object: modules, changes, crossings
    python scripts/trace_forward.py --modules  # and the module sequence

The sequence is the module of each Python function the forward calls (consecutive repeats
merged); ``crossings`` counts the changes between ``moeflow.moe`` and ``moeflow.parallel`` in it,
other packages in between left out. ``tests/test_forward_trace.py`` holds the targets.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from types import FrameType
from typing import Any

import torch

LAYER_PACKAGE = "moeflow.moe"
TECHNIQUES_PACKAGE = "moeflow.parallel"


def traced_forward(model_dim: int = 32, num_experts: int = 4, tokens: int = 64) -> list[str]:
    """The moeflow modules one default training forward runs through, in order."""
    from moeflow import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(model_dim, 2 * model_dim, num_experts).train()
    x = torch.randn(tokens, model_dim, requires_grad=True)
    layer(x).sum().backward()  # a first step: whatever runs once (workspaces, kernel choice) runs here
    sequence: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "") if event == "call" else ""
        if module.startswith("moeflow.") and (not sequence or sequence[-1] != module):
            sequence.append(module)

    sys.setprofile(profile)
    try:
        layer(x)
    finally:
        sys.setprofile(None)
    return sequence


def summary(sequence: list[str]) -> dict[str, Any]:
    """Distinct modules, module changes, A -> B -> A hops and layer/techniques crossings."""
    ours = [m for m in sequence if m.startswith((LAYER_PACKAGE + ".", TECHNIQUES_PACKAGE + "."))]
    packages = [LAYER_PACKAGE if m.startswith(LAYER_PACKAGE + ".") else TECHNIQUES_PACKAGE for m in ours]
    crossings = sum(a != b for a, b in itertools.pairwise(packages))
    hops = sum(a == c != b for a, b, c in zip(sequence, sequence[1:], sequence[2:], strict=False))
    return {"modules": len(set(sequence)), "changes": len(sequence) - 1, "hops": hops, "crossings": crossings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", action="store_true", help="also print the module sequence")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sequence = traced_forward()
    record = summary(sequence)
    if args.modules:
        record["sequence"] = sequence
    print(json.dumps(record))


if __name__ == "__main__":
    main()
