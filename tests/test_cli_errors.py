"""Mistyped input, as a new user types it: every case exits non-zero at once with one line that
names the argument (or file) and the fix, and no traceback (issue 61). In-process: an uncaught
exception would fail the test instead of exiting."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeflow.cli import main

FILES = {"unknown_key.toml": "stepz = 10\n", "bad_value.toml": 'steps = "many"\n', "broken.toml": "steps = [\n",
         "broken.json": '{"steps": 1,', "list.yaml": "- steps\n"}

CASES = [  # (argv, what the message names); {dir} is a folder of the files above
    (["train", "--steps", "ten"], "--steps"),
    (["train", "--steps", "-5"], "steps"),
    (["train", "--workers", "0"], "workers"),
    (["train", "--dtype", "fp64"], "dtype"),
    (["train", "--expert-kernel", "raged"], "expert_kernel"),
    (["train", "--num-experts", "4", "--top-k", "8"], "top_k"),
    (["train", "--wire-dtype", "fp16"], "wire_dtype"),
    (["train", "--wire-dtype", "bf16", "--mp-size", "2", "--heads", "4"], "wire_dtype='exact'"),
    (["plan", "--cluster", "fastermoe-johnny", "--model", "fastermoe-gpt", "--wire-dtype", "fp16"], "--wire-dtype"),
    (["plan", "--cluster", "fastermoe-johnny", "--model", "fastermoe-gpt", "--wire-dtype", "bf16", "--mp", "2"],
     "wire_dtype='exact'"),
    (["bench", "wire", "--loss-only", "--train-steps", "0"], "--train-steps"),
    (["train", "--token-exchange", "dedupe"], "dedup"),
    (["train", "--token-exchange", "dedup", "--redundant-experts", "2"], "token_exchange='dedup'"),
    (["bench", "dedup", "--top-k", "3", "--experts-per-rank", "1"], "--experts-per-rank"),
    (["train", "--config", "{dir}/unknown_key.toml"], "'stepz'"),
    (["train", "--config", "{dir}/bad_value.toml"], "steps"),
    (["train", "--config", "{dir}/broken.toml"], "broken.toml"),
    (["train", "--config", "{dir}/broken.json"], "broken.json"),
    (["train", "--config", "{dir}/list.yaml"], "list.yaml"),
    (["train", "--config", "{dir}/missing.toml"], "missing.toml"),
    (["train", "--resume", "{dir}/no-run"], "--resume"),
    (["train", "--config", "{dir}/unknown_key.toml", "--resume", "{dir}"], "--resume"),
    (["generate", "--hf", "{dir}/no-model", "--prompts", "{dir}/p.txt"], "no-model"),
    (["export", "{dir}/no-run", "--out", "{dir}/x"], "no-run"),
    (["plan", "--profile", "{dir}/missing.json"], "missing.json"),
    (["simulate", "--cluster", "no-such-cluster"], "no-such-cluster"),
    (["calibrate", "--device", "tpu"], "--device"),
    (["bench", "layer", "--tokens", "-1"], "--tokens"),
    (["bench", "layer", "--expert-kernel", "raged"], "--expert-kernel"),
    (["bench", "kernels", "--device", "npu"], "--device"),
    (["no-such-command"], "no-such-command"),
]


@pytest.mark.parametrize(("argv", "named"), CASES, ids=lambda value: " ".join(value) if isinstance(value, list)
                         else None)
def test_mistyped_input_exits_with_one_line_naming_it(argv: list[str], named: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    try:  # a command returns its exit status, or raises SystemExit (argparse, moeflow.commands.fail)
        code: object = main([part.replace("{dir}", str(tmp_path)) for part in argv])
    except SystemExit as exited:
        code = exited.code
    assert code not in (0, None)
    message = code if isinstance(code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert named in message and message.startswith("moeflow") and "Traceback" not in message, message
    assert "\n" not in message
