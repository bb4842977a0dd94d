"""``moeflow export``: a checkpoint as safetensors shards, one layer at a time: a transformers
directory for a ``train --hf`` run, moeflow's own tensors otherwise."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moeflow.commands import add_progress_flag, show_progress


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "export", help="write a checkpoint as safetensors one layer at a time (a transformers directory for --hf runs)"
    )
    parser.add_argument("checkpoint", help="a run folder (its newest checkpoint) or one of its checkpoints/step-* "
                        "folders")
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write (replaced if present)")
    parser.add_argument("--tokenizer-from", metavar="DIR",
                        help="--hf runs: copy the tokenizer files from this directory (default: the run's --hf "
                        "model directory, if it still exists)")
    add_progress_flag(parser)
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from moeflow.progress import progress_bar
    from moeflow.training.checkpoint import latest_checkpoint, read_state
    from moeflow.training.export import INDEX
    from moeflow.training.sharded_checkpoint import METADATA

    checkpoint = latest_checkpoint(Path(args.checkpoint))
    if checkpoint is None or not (checkpoint / METADATA).is_file():
        print(f"moeflow export: error: {args.checkpoint!r} holds no sharded checkpoint (a run folder written by "
              "moeflow train, or one of its checkpoints/step-* folders)", file=sys.stderr)
        return 2
    source = read_state(checkpoint)["config"].get("hf")
    out = Path(args.out)
    with progress_bar("export", "shard", enabled=show_progress(args)) as progress:
        if source is not None:
            from moeflow.training.hf_export import export_hf

            tokenizer = Path(args.tokenizer_from or source)
            export_hf(checkpoint, out, tokenizer if tokenizer.is_dir() else None, progress)
        else:
            from moeflow.training.export import export_model

            export_model(checkpoint, out, progress)
    index = json.loads((out / INDEX).read_text())
    print(json.dumps({"summary": "export", "checkpoint": str(checkpoint), "out": str(out), "hf": source is not None,
                      "tensors": len(index["weight_map"]), "shards": len(set(index["weight_map"].values())),
                      "bytes": index["metadata"]["total_size"]}))
    return 0
