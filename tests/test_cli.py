"""`moeflow bench layer`: JSON lines with the promised fields, a summary, clear argument errors."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import warnings

import pytest

from moeflow.cli import main

FIELDS = {"moeflow_ms", "reference_ms", "speedup_vs_reference", "floor_ms", "ratio_to_floor",
          "encode_decode_share", "matmul_gflops", "expert_kernel_ms", "experts", "hidden_dim", "tokens",
          "gemm_floor_ms", "ratio_to_gemm_floor", "device", "dtype"}


def test_bench_layer_prints_json_per_config_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "layer", "--tokens", "64", "--model-dim", "16", "--repeats", "1", "--warmup", "0"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["experts"] for line in lines[:-1]] == [8, 64]
    assert all(set(line) >= FIELDS for line in lines[:-1])
    assert all(line["moeflow_ms"] > 0 and 0 < line["encode_decode_share"] < 1 for line in lines[:-1])
    assert lines[-1]["summary"] == "layer" and lines[-1]["configurations"] == 2


@pytest.mark.distributed
def test_bench_layer_with_workers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "moeflow", "bench", "layer", "--workers", "2", "--tokens", "32",
         "--model-dim", "16", "--num-experts", "4", "--hidden-dim", "16", "--repeats", "1", "--no-kernels"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout.splitlines()
    first = json.loads(out[0])
    assert first["workers"] == 2 and first["experts"] == 4 and "expert_kernel_ms" not in first


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-experts", "4", "--hidden-dim", "8", "--top-k", "5"], "--top-k 5 exceeds --num-experts 4"),
        (["--num-experts", "6", "--hidden-dim", "8", "--workers", "4"],
         "--num-experts 6 is not divisible by --workers 4"),
        (["--device", "tpu0"], "--device 'tpu0' is not a device; use cpu or cuda"),
    ],
)
def test_bench_layer_argument_errors(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "layer", *argv])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "layer", "--experts", "4"], 4),
        (["bench", "kernels", "--experts", "16"], 16),
        (["bench", "overlap", "--experts", "2"], 2),
        (["bench", "skew", "--experts", "8"], 8),
        (["bench", "schedules", "--experts", "2", "4"], [2, 4]),
        (["bench", "parallel", "--experts", "1", "2"], [1, 2]),
    ],
)
def test_the_old_experts_flag_reads_as_num_experts_with_a_warning(argv: list[str], expected: object) -> None:
    from moeflow.cli import build_parser

    with pytest.warns(FutureWarning, match="--experts is renamed --num-experts"):
        args = build_parser().parse_args(argv)
    assert args.num_experts == expected and "experts" not in vars(args)
    new = [("--num-experts" if word == "--experts" else word) for word in argv]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns of nothing
        assert build_parser().parse_args(new).num_experts == expected


def test_bench_layer_config_keeps_its_record_keys() -> None:
    from moeflow.bench.layer import LayerBenchConfig
    from moeflow.config import LayerDims

    config = LayerBenchConfig(dims=LayerDims(16, 32, 4, top_k=2, projections=3), activation="swiglu")
    fields = config.record_fields()
    assert (fields["model_dim"], fields["hidden_dim"], fields["experts"], fields["top_k"]) == (16, 32, 4, 2)
    assert "dims" not in fields and "num_experts" not in fields
    with pytest.raises(ValueError, match="projections"):
        LayerBenchConfig(dims=LayerDims(16, 32, 4), activation="swiglu")


def test_interleaved_medians_time_round_robin_and_skip_warmup() -> None:
    from moeflow.timing.measure import interleaved_medians

    calls: list[str] = []
    medians = interleaved_medians(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=2,
        before_each=lambda: calls.append("|"),
    )
    assert calls == ["|", "a", "|", "b"] * 5
    assert set(medians) == {"a", "b"} and all(v >= 0 for v in medians.values())


def test_bench_alltoall_rejects_bad_layouts() -> None:
    with pytest.raises(SystemExit, match="--layouts takes NODESxRANKS like 2x2"):
        main(["bench", "alltoall", "--layouts", "2by2"])


def test_alltoall_summary_finds_the_crossover() -> None:
    from moeflow.bench.alltoall import summarize

    def record(size: int, algorithm: str, ms: float) -> dict:
        return {"nodes": 4, "ranks_per_node": 2, "bytes_per_destination": size, "algorithm": algorithm, "ms": ms,
                "latency_emulated": True}

    results = [record(1024, "linear", 2.0), record(1024, "2dh", 1.0), record(1024, "pairwise", 4.0),
               record(65536, "linear", 3.0), record(65536, "2dh", 2.5), record(65536, "pairwise", 3.0),
               record(1 << 20, "linear", 10.0), record(1 << 20, "2dh", 12.0), record(1 << 20, "pairwise", 10.0)]
    layout = summarize(results)["layouts"]["4x2"]
    assert layout["2dh_wins_up_to_bytes"] == 65536
    assert layout["2dh_speedup_over_linear"]["1024"] == 2.0


def _subparsers(parser: argparse.ArgumentParser, path: str = "moeflow") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:  # argparse keeps subcommands here; there is no public walker
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _subparsers(sub, f"{path} {name}")
    return found


def test_every_flag_of_every_command_says_what_it_does() -> None:
    from moeflow.cli import build_parser

    missing = []
    for path, parser in _subparsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            text = (action.help or "").strip()
            if not text or text.startswith("(default"):
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"flags without a help line: {missing}"


def test_every_train_setting_has_its_help() -> None:
    from dataclasses import fields

    from moeflow.training.config import FIELD_HELP, TrainConfig

    assert set(FIELD_HELP) == {f.name for f in fields(TrainConfig)}
    assert all(len(text) > 10 for text in FIELD_HELP.values())


@pytest.mark.parametrize("bias", [[], ["--no-bias"]])
def test_bench_layer_in_bf16(bias: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "layer", "--tokens", "32", "--model-dim", "16", "--num-experts", "4", "--hidden-dim", "16",
                 "--repeats", "1", "--warmup", "0", "--dtype", "bf16", "--no-kernels", "--matmul-size", "64",
                 *bias]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["dtype"] == "bf16" and first["ratio_to_gemm_floor"] > 0
    assert first["bias"] is not bool(bias)  # the real models' experts have none: --no-bias times them so


def test_bench_kernels_reports_rates_against_the_measured_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kernels", "--tokens", "256", "--model-dim", "64", "--hidden-dim", "64",
                 "--num-experts", "8", "--top-k", "2", "--matmul-size", "256", "--repeats", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_kernel = {(r["kernel"], r.get("backend")): r for r in lines[:-1]}
    assert by_kernel[("matmul", None)]["tflops"] > 0 and by_kernel[("copy", None)]["gb_per_s"] > 0
    assert by_kernel[("encode", "torch")]["share_of_bandwidth"] > 0
    assert by_kernel[("decode", "torch")]["gb_per_s"] > 0 and by_kernel[("grouped_gemm", "torch")]["tflops"] > 0
    summary = lines[-1]
    assert summary["summary"] == "kernels" and summary["encode_decode_target_met"] is None  # a CPU run
    assert set(summary["best"]) >= {"encode", "decode", "grouped_gemm"}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_bench_on_cuda_without_a_gpu_names_the_fix() -> None:
    with pytest.raises(SystemExit, match="--device cuda needs a CUDA GPU and this machine has none"):
        main(["bench", "kernels", "--device", "cuda"])


def test_bench_overlap_reports_each_degree_against_the_ideal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overlap", "--num-experts", "2", "--capacity", "64", "--model-dim", "32",
                 "--hidden-dim", "64", "--degrees", "1", "4", "--repeats", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["degree"] for line in lines[:-1]] == [1, 4]
    assert all(line["ideal_ms"] == max(line["comp_ms"], line["copy_ms"]) > 0 for line in lines[:-1])
    assert lines[-1]["summary"] == "overlap" and lines[-1]["best_degree"] in (1, 4)
    with pytest.raises(SystemExit, match=r"--degrees must lie in 1\.\.--capacity"):
        main(["bench", "overlap", "--capacity", "4", "--degrees", "8"])


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and positionals of one parser (no -h, no subcommand choice)."""
    return [action for action in parser._actions
            if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)]


def _says_something(text: str) -> bool:
    """Help that still has words once its default is taken out ('(default 5)', '; default: x')."""
    text = re.sub(r"\(default[^)]*\)", "", text)
    text = re.sub(r"(^|[;,]\s*)default\b.*$", "", text.strip(), flags=re.IGNORECASE)
    return len(re.findall(r"[A-Za-z]{2,}", text)) >= 2


def test_every_option_of_every_parser_has_help_saying_what_it_does() -> None:
    """All parsers, the nested bench subcommands too; only deprecated aliases (hidden on purpose, with
    help=argparse.SUPPRESS) are exempt."""
    from moeflow.cli import build_parser
    from moeflow.commands import RenamedFlag

    parsers = _subparsers(build_parser())
    paths = {path for path, _ in parsers}
    assert {"moeflow train", "moeflow bench layer", "moeflow bench papers", "moeflow cluster"} <= paths
    missing, hidden = [], []
    for path, parser in parsers:
        for action in _options(parser):
            name = f"{path} {'/'.join(action.option_strings) or action.dest}"
            if action.help == argparse.SUPPRESS:
                if not isinstance(action, RenamedFlag):
                    hidden.append(name)
                continue
            if not _says_something(action.help or ""):
                missing.append(f"{name}: {action.help!r}")
    assert not missing, f"options whose help does not say what they do: {missing}"
    assert not hidden, f"hidden options that are not deprecated aliases: {hidden}"


def test_the_help_check_catches_empty_and_default_only_texts() -> None:
    assert not _says_something("")
    assert not _says_something("default fp32")
    assert not _says_something("(default 5)")
    assert not _says_something("default: bf16 on CUDA, fp32 on CPU")
    assert _says_something("timed rounds, medians (default 5)")
    assert _says_something("--hf: new tokens per prompt (default 64)")


def test_every_subcommand_has_a_one_line_help() -> None:
    from moeflow.cli import build_parser

    for path, parser in _subparsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) and path != "moeflow":  # bench's own listing
                helps = {choice.dest: choice.help for choice in action._choices_actions}
                assert set(helps) == set(action.choices), path
                assert all(_says_something(text or "") for text in helps.values()), (path, helps)


def _top_level_commands() -> dict[str, argparse.ArgumentParser]:
    from moeflow.cli import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_every_subcommand_is_in_exactly_one_group() -> None:
    from moeflow.cli import COMMAND_GROUPS

    grouped = [name for _, _, names in COMMAND_GROUPS for name in names]
    assert sorted(grouped) == sorted(_top_level_commands())  # each registered once, nothing extra
    assert len(grouped) == len(set(grouped))
    assert [group for group, _, _ in COMMAND_GROUPS] == ["run", "inspect", "plan", "benchmark", "cluster"]


def test_moeflow_help_lists_the_commands_by_group(capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.cli import COMMAND_GROUPS

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    sections = text.split("\ncommands:\n", 1)[1]
    starts = [sections.index(f"  {group}: {purpose}\n") for group, purpose, _ in COMMAND_GROUPS]
    assert starts == sorted(starts)
    for (group, _, names), start, end in zip(COMMAND_GROUPS, starts, [*starts[1:], len(sections)], strict=True):
        listed = re.findall(r"^    (\S+)  ", sections[start:end], flags=re.MULTILINE)
        assert listed == list(names), group
    assert "moeflow COMMAND --help" in text
    assert "{train," not in text  # the grouped listing replaces argparse's flat one


def test_a_subcommand_without_a_group_is_refused() -> None:
    from moeflow.cli import COMMAND_GROUPS, grouped_commands

    helps = {name: "does something useful" for _, _, names in COMMAND_GROUPS for name in names}
    assert "train" in grouped_commands(helps)
    with pytest.raises(RuntimeError, match=r"ungrouped \['serve'\]"):
        grouped_commands({**helps, "serve": "a command nobody placed in a group"})
