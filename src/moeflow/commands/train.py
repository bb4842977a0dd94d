"""``moeflow train | report``: train flags are generated from :class:`TrainConfig` (and
their help from its ``FIELD_HELP``), so a flag, a config-file key and a key of the saved
``config.json`` are the same setting."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from moeflow.commands import add_renamed_flag
from moeflow.files import json_text
from moeflow.training.config import (
    FIELD_HELP,
    LEGACY_GATES,
    RENAMED_KEYS,
    TrainConfig,
    checked_keys,
    load_config_file,
)


def _int_or_name(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def _number_or_name(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _flag_type(annotation: str) -> Any:
    if annotation.startswith("int | str"):
        return _int_or_name
    if annotation.startswith("str | float"):
        return _number_or_name
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_parser(commands: Any) -> None:
    _add_train(commands)
    report = commands.add_parser("report", help="regenerate a run's plots and summary from its metrics.jsonl")
    report.add_argument("run_dir", help="the run folder (holds metrics.jsonl)")
    report.set_defaults(func=run_report)


def _add_train(commands: Any) -> None:
    train = commands.add_parser(
        "train", help="train an MoE language model (the main job)",
        description="Train a decoder-only MoE transformer on the Python standard library's sources (or --data) "
        "with --workers gloo processes; writes metrics.jsonl, plots and checkpoints into --run-dir. Under "
        "torchrun or moeflow launch each process runs as its launched rank.",
        argument_default=argparse.SUPPRESS,
    )
    train.add_argument("--config", dest="config_file", help="a TOML, YAML or JSON file of settings (flags win)")
    train.add_argument("--resume", help="continue the run in this folder from its newest checkpoint")
    annotations = {field.name: str(field.type) for field in fields(TrainConfig)}
    for field in fields(TrainConfig):
        annotation = annotations[field.name]
        help_text = f"{FIELD_HELP[field.name]} (default {field.default})"
        if annotation == "bool":
            train.add_argument(_flag(field.name), dest=field.name, action=argparse.BooleanOptionalAction,
                               help=help_text)
        else:
            train.add_argument(_flag(field.name), dest=field.name, type=_flag_type(annotation),
                               metavar=field.name.upper(), help=help_text)
    for old, new in RENAMED_KEYS.items():  # the old spellings of renamed settings, deprecated
        add_renamed_flag(train, _flag(old), _flag(new), type=_flag_type(annotations[new]))
    train.add_argument("--gate", dest="gate", choices=LEGACY_GATES, help="renamed --topology-gate: plain is off, "
                       "topology is auto with --profile, else FastMoE's share")
    train.set_defaults(func=run_train)


def train_config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, Path | None]:
    """Defaults < plan file (--plan) < config file < flags; with --resume, the resumed run's config < flags."""
    from moeflow.training.launch import resume_config
    from moeflow.training.plan_file import read_plan_file

    names = {f.name for f in fields(TrainConfig)} | {"gate"}  # gate: the old name of topology_gate
    flags = checked_keys({name: value for name, value in vars(args).items() if name in names}, source="flag")
    if getattr(args, "resume", None):
        if getattr(args, "config_file", None):
            raise ValueError("--config and --resume do not combine: a resumed run keeps its saved config (flags win)")
        return resume_config(args.resume, flags)
    values = load_config_file(args.config_file) if getattr(args, "config_file", None) else {}
    plan = flags.get("plan", values.get("plan"))
    planned = read_plan_file(plan)[0] if plan else {}
    return TrainConfig(**{**planned, **values, **flags}), None


def run_train(args: argparse.Namespace) -> int:
    from moeflow.distributed import WorkerError
    from moeflow.progress import wants_progress
    from moeflow.training.launch import run_training

    try:
        config, checkpoint = train_config_from_args(args)
        if config.progress and not wants_progress(sys.stderr, True):  # a bar only where a person watches
            config = config.updated({"progress": False})
        summary = run_training(config, checkpoint)
    except (ValueError, FileNotFoundError, FileExistsError, TypeError) as error:
        print(f"moeflow train: error: {error}", file=sys.stderr)
        return 2
    except WorkerError as error:
        print(f"moeflow train: the job failed: {error}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":  # under a launcher, one summary line
        return 0
    if summary.get("complete"):
        print(f"moeflow train: the run in {summary['run_dir']} is complete (step {summary['step']} of "
              f"{summary['steps']}): nothing to train; resume with a larger --steps to go on", file=sys.stderr)
    print(json_text({"summary": "train", **summary}))
    return 0


def run_report(args: argparse.Namespace) -> int:
    from moeflow.training.report import write_report

    try:
        summary = write_report(Path(args.run_dir))
    except (FileNotFoundError, ValueError) as error:
        print(f"moeflow report: error: {error}", file=sys.stderr)
        return 2
    print(json_text({"summary": "report", "run_dir": args.run_dir, **summary}))
    return 0


__all__ = ["add_parser", "run_report", "run_train", "train_config_from_args"]
