"""``moeflow profile-routing``: record which experts each token path leads to (Lina's profiling),
for ``moeflow generate --schedule lina``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from moeflow.commands import positive_int


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "profile-routing", help="record the experts each token path leads to, for generate --schedule lina"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a moeflow run folder or one of its checkpoints/step-* folders")
    source.add_argument("--hf", metavar="DIR", help="a local transformers MoE model directory")
    parser.add_argument("--corpus", metavar="FILE",
                        help="a text file to profile on (--checkpoint: default the run's training split)")
    parser.add_argument("--tokens", type=positive_int, default=32768, help="tokens to profile (default 32768)")
    parser.add_argument("--path-length", type=positive_int, default=3,
                        help="Lina's path length l: how many earlier layers' choices a token's path holds "
                        "(default 3)")
    parser.add_argument("--context", type=positive_int, default=None,
                        help="tokens per sequence (default: the checkpoint's context; --hf: 256)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward (default 8)")
    parser.add_argument("--output", metavar="FILE", help="where to write the profile "
                        "(default: routing_profile.safetensors beside the model)")
    parser.add_argument("--dtype", default=None, help="--hf: load the model in this dtype: fp32, bf16, fp16 or "
                        "torch's names (default: as saved)")
    parser.set_defaults(func=run_profile_routing)


def run_profile_routing(args: argparse.Namespace) -> int:
    from moeflow.inference.paths import PROFILE_FILE
    from moeflow.inference.profiling import profile_routing, token_batches

    try:
        if args.hf is not None:
            layers, forward, ids, context, home = _hf_model(args)
        else:
            layers, forward, ids, context, home = _checkpoint_model(args)
        batches = token_batches(ids, context, args.batch_size, args.tokens)
        profile = profile_routing(layers, forward, batches, args.path_length)
    except (FileNotFoundError, ValueError) as error:
        print(f"moeflow profile-routing: error: {error}", file=sys.stderr)
        return 2
    target = Path(args.output) if args.output else home / PROFILE_FILE
    profile.save(target)
    paths = [[len(table.keys) for table in layer] for layer in profile.tables]
    print(json.dumps({"profile": str(target), "tokens": profile.tokens, "layers": profile.num_layers,
                      "experts": profile.num_experts, "top_k": profile.top_k, "path_length": profile.path_length,
                      "paths_per_layer_and_length": paths, "fingerprint": profile.fingerprint}))
    return 0


def _checkpoint_model(args: argparse.Namespace) -> tuple[list[Any], Any, Any, int, Path]:
    import numpy as np

    from moeflow.training.generate import load_model

    model, tokenizer, checkpoint = load_model(args.checkpoint)
    if args.corpus is not None:
        ids = np.asarray(tokenizer.encode(_read_corpus(args.corpus)).ids)
    else:
        ids = _training_split(checkpoint)
    return model.moe_layers(), model, ids, args.context or model.config.context, checkpoint


def _training_split(checkpoint: Path) -> Any:
    """The token stream the run trained on (the corpus cache of this machine, built if missing)."""
    from moeflow.data import default_cache_root
    from moeflow.training.generate import checkpoint_corpus

    return checkpoint_corpus(checkpoint, default_cache_root(os.environ)).load("train")


def _hf_model(args: argparse.Namespace) -> tuple[list[Any], Any, Any, int, Path]:
    import numpy as np

    from moeflow.hf.blocks import moe_blocks
    from moeflow.hf.loading import check_model_dir, load_hf_model, load_hf_tokenizer

    directory = check_model_dir(args.hf)
    if args.corpus is None:
        raise ValueError("--hf needs --corpus FILE (a text file to profile on)")
    tokenizer = load_hf_tokenizer(directory)
    if tokenizer is None:
        raise ValueError(f"{args.hf!r} has no tokenizer to read --corpus with")
    model = load_hf_model(directory, args.dtype)
    ids = np.asarray(tokenizer(_read_corpus(args.corpus))["input_ids"])

    def forward(batch: Any) -> Any:
        return model(input_ids=batch, use_cache=False)

    return [block.moe for block in moe_blocks(model)], forward, ids, args.context or 256, directory


def _read_corpus(path: str) -> str:
    if not Path(path).is_file():
        raise FileNotFoundError(f"--corpus {path!r} is not a file")
    return Path(path).read_text()
