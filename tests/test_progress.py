"""Progress of long commands (issue 82, item 6): a bar with the rate and the time left on a
terminal's stderr, nothing in CI or a log, and stdout the same either way."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from moeflow.cli import build_parser, main
from moeflow.progress import Quiet, progress_bar, wants_progress

PLAN = ["plan", "--cluster", "fastermoe-johnny", "--model", "fastermoe-gpt", "--top", "2"]
LONG_COMMANDS = [("calibrate",), ("simulate",), ("plan",), ("export",), ("bench", "layer"), ("bench", "generate"),
                 ("bench", "lina-inference"), *[("bench", name) for name in (
                     "contention", "dedup", "exchange", "hf-ep", "parallel", "pipeline", "schedules", "skew", "stages",
                     "wire", "alltoall", "kernels", "overlap", "memory", "simulator", "plan", "train", "faults",
                     "papers")]]
"""The commands that draw a bar: each takes --no-progress."""


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as a person's stderr does."""

    def isatty(self) -> bool:
        return True


class Counted:
    """A Progress that records what a loop reported."""

    def __init__(self) -> None:
        self.expected, self.done, self.notes = 0, 0, []

    def expect(self, items: int) -> None:
        self.expected += items

    def advance(self, items: int = 1) -> None:
        self.done += items

    def note(self, text: str) -> None:
        self.notes.append(text)


@pytest.fixture
def shown_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bars drawn from the start: the commands here end before the usual delay."""
    monkeypatch.setattr("moeflow.progress.SHOW_AFTER_S", 0.0)


def test_a_bar_only_on_a_terminal_and_not_when_turned_off() -> None:
    assert wants_progress(Terminal())
    assert not wants_progress(Terminal(), requested=False)
    assert not wants_progress(io.StringIO())  # a log, a CI job's captured output
    assert not wants_progress(object())  # no isatty at all
    assert not wants_progress(None)


def test_off_it_is_quiet_and_loads_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    with progress_bar("work", "item", 3, enabled=False) as progress:
        assert isinstance(progress, Quiet)
        progress.expect(2)
        progress.advance()
        progress.note("phase")
        print("record")
    assert capsys.readouterr() == ("record\n", "")


def test_on_the_bar_shows_rate_and_time_left_and_lines_pass_through_unchanged(
        monkeypatch: pytest.MonkeyPatch, shown_at_once: None) -> None:
    out, err = io.StringIO(), Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with contextlib.redirect_stdout(out), progress_bar("work", "item", enabled=True) as progress:
        progress.expect(4)
        for number in range(4):
            print(json.dumps({"n": number}), flush=True)
            print("partial", end="")
            progress.advance()
        print()
    assert out.getvalue() == "".join(f'{{"n": {n}}}\npartial' for n in range(4)) + "\n"
    assert "4/4" in err.getvalue() and "item/s" in err.getvalue() and "<" in err.getvalue()


@pytest.mark.parametrize("command", LONG_COMMANDS, ids=" ".join)
def test_every_long_command_takes_no_progress(command: tuple[str, ...]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    assert "--no-progress" in out.getvalue()


def test_the_flag_turns_the_bar_off_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeflow.commands import show_progress

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert show_progress(argparse.Namespace(progress=True))
    assert not show_progress(argparse.Namespace(progress=False))
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not show_progress(argparse.Namespace(progress=True))


def _run(argv: list[str], stderr: io.StringIO, capsys: pytest.CaptureFixture[str],
         monkeypatch: pytest.MonkeyPatch) -> str:
    """The command's stdout, run with ``stderr`` as its stderr."""
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", stderr)
        assert main(argv) == 0
    return capsys.readouterr().out


def test_plan_on_a_terminal_shows_its_search_and_prints_the_same_plans(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, shown_at_once: None) -> None:
    log, terminal, turned_off = io.StringIO(), Terminal(), Terminal()
    logged = _run(PLAN, log, capsys, monkeypatch)
    watched = _run(PLAN, terminal, capsys, monkeypatch)
    quiet = _run([*PLAN, "--no-progress"], turned_off, capsys, monkeypatch)
    assert watched == logged == quiet and "best plan" in logged
    assert "sim/s" in terminal.getvalue() and "<" in terminal.getvalue() and "plan:" in terminal.getvalue()
    assert log.getvalue() == "" and turned_off.getvalue() == ""


def test_simulate_counts_its_plans_on_a_terminal(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch, shown_at_once: None) -> None:
    terminal = Terminal()
    out = _run(["simulate", "--cluster", "tutel-a100", "--nodes", "2", "--layers", "1", "--num-experts", "16",
                "--degree", "1,2"], terminal, capsys, monkeypatch)
    assert len(out.splitlines()) == 3  # two plans and the summary, as without a bar
    assert "2/2" in terminal.getvalue() and "plan/s" in terminal.getvalue()


def test_the_planner_search_counts_every_simulation() -> None:
    from moeflow.sim import load_cluster, load_model
    from moeflow.sim.planner import search

    counted = Counted()
    results = search(load_cluster("fastermoe-johnny"), load_model("fastermoe-gpt"), top=2, progress=counted)
    assert len(results) == 2 and counted.done == counted.expected > 2


def test_an_export_counts_its_shards(tmp_path: Path) -> None:
    from moeflow.training.export import write_shards

    counted = Counted()
    tensors = {"layers.0.w": torch.ones(2), "layers.1.w": torch.zeros(3), "head.w": torch.ones(1)}
    write_shards(tmp_path / "out", [["layers.0.w"], ["layers.1.w"], ["head.w"]],
                 lambda names: {name: tensors[name] for name in names}, lambda folder: None, counted)
    assert counted.expected == counted.done == 3 and len(list((tmp_path / "out").glob("*.safetensors"))) == 3


def test_a_grid_benchmark_counts_rank_zeros_points_and_prints_only_records(
        capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.bench import POINT_DONE, RankZeroRecords

    counted = Counted()
    sink = RankZeroRecords(counted, nodes=2)
    sink.write('[rank 0] {"bench": "x", "ms": 1.0}\n[rank 1] ' + POINT_DONE + "\n[rank 0] " + POINT_DONE + "\n")
    assert counted.done == 1 and sink.records == [{"bench": "x", "ms": 1.0, "nodes": 2}]
    assert capsys.readouterr().out == '{"bench": "x", "ms": 1.0, "nodes": 2}\n'


def test_calibration_names_each_measurement_as_it_goes() -> None:
    from moeflow.calibrate import CalibrationConfig, _measurements

    one = _measurements(CalibrationConfig(), 1, None)  # type: ignore[arg-type]
    two = _measurements(CalibrationConfig(), 2, None)  # type: ignore[arg-type]
    assert list(one) == ["gemm", "ffn", "dispatch", "layer"]
    assert list(two) == ["gemm", "ffn", "dispatch", "collectives", "interference", "layer", "pipelined"]


def test_bench_overlap_counts_its_samples_on_a_terminal_and_prints_the_same_records(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, shown_at_once: None) -> None:
    overlap = ["bench", "overlap", "--num-experts", "2", "--capacity", "16", "--model-dim", "16", "--hidden-dim", "16",
               "--degrees", "1", "2", "--repeats", "1"]
    terminal, turned_off = Terminal(), Terminal()
    watched = _run(overlap, terminal, capsys, monkeypatch)
    quiet = _run([*overlap, "--no-progress"], turned_off, capsys, monkeypatch)
    keys = [sorted(json.loads(line)) for line in watched.splitlines()]
    assert keys == [sorted(json.loads(line)) for line in quiet.splitlines()] and len(keys) == 3  # 2 degrees, summary
    assert "8/8" in terminal.getvalue() and "sample/s" in terminal.getvalue()  # (comp, copy, d1, d2) x 2 rounds
    assert turned_off.getvalue() == ""


def test_bench_kernels_counts_every_sample() -> None:
    from moeflow.bench.kernels import KernelBenchConfig, measure_kernels

    counted = Counted()
    config = KernelBenchConfig(tokens=32, model_dim=16, hidden_dim=16, num_experts=4, top_k=2, device="cpu",
                               dtype="fp32", matmul_size=32, copy_mb=1, repeats=2, warmup=1)
    records = measure_kernels(config, counted)
    timed = [r for r in records if r["kernel"] != "auto"]  # one record per timed function
    assert counted.expected == counted.done == 3 * len(timed)


def test_bench_alltoall_counts_each_layout_and_size(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from moeflow.bench import POINT_DONE, alltoall

    def launch(spec: object, command: list[str], sink: io.StringIO, **_: object) -> int:
        for size in command[command.index("--sizes") + 1:command.index("--repeats")]:
            sink.write(f'[rank 0] {{"bench": "alltoall", "bytes_per_destination": {size}}}\n[rank 0] {POINT_DONE}\n')
        return 0

    monkeypatch.setattr("moeflow.testbed.launch", launch)
    counted = Counted()
    records = alltoall.run([(2, 1), (1, 2)], [1024, 4096, 16384], 1.0, 0.0, 1, progress=counted)
    assert counted.expected == counted.done == 6 and len(records) == 6
    assert len(capsys.readouterr().out.splitlines()) == 6  # the records alone


def test_bench_plan_counts_its_calibration_and_every_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from moeflow.bench import plan_runs

    plans = [(tmp_path / f"plan-{n}.toml", {"label": f"p{n}", "predicted_step_ms": 1.0}) for n in (1, 2)]
    monkeypatch.setattr(plan_runs, "calibrate", lambda spec, path, port: path)
    monkeypatch.setattr(plan_runs, "plan_files", lambda profile, settings, folder, top: plans)
    monkeypatch.setattr(plan_runs, "train_run", lambda spec, plan, run_dir, port: 2.0)
    spec = argparse.Namespace(nodes=2, ranks_per_node=1, inter_gbit=1.0)
    counted = Counted()
    records = plan_runs.run(spec, tmp_path, {}, 2, 3, None, emit=lambda line: None, progress=counted)
    assert len(records) == 2 and counted.expected == counted.done == 1 + 2 * 3


def test_bench_simulator_counts_calibrations_and_points_even_where_ranks_report_none(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from moeflow.bench import sim_validation

    def run_on_cluster(module: str, name: str, grid: list[object], *rest: object, progress: Counted | None = None,
                       **_: object) -> list[dict[str, object]]:
        if progress is not None and module != "moeflow.bench.pipeline":  # as a run that reports no point done
            progress.expect(len(grid))
            progress.advance(len(grid))
        return []

    class Profile:
        def save(self, path: Path) -> None:
            pass

    monkeypatch.setattr("moeflow.bench.run_on_cluster", run_on_cluster)
    monkeypatch.setattr("moeflow.perf.profile.ClusterProfile.load", staticmethod(lambda path: Profile()))
    monkeypatch.setattr("moeflow.perf.profile.median_profile", lambda runs: Profile())
    monkeypatch.setattr(sim_validation, "compare", lambda *args: [])
    counted = Counted()
    sim_validation.run(((2, 1), (2, 2)), (1.0,), list(sim_validation.GRID), 1, tmp_path, print, ("pipeline", "skew"),
                       counted)
    points = len(sim_validation.GRID) + len(sim_validation.SKEW_GRID)
    assert counted.expected == counted.done == 2 * (sim_validation.CALIBRATIONS + points)


def test_bench_faults_counts_each_fault(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.bench import faults

    record = {"fault": "delay", "ended": "completed", "report": []}
    monkeypatch.setattr(faults, "run_training", lambda *args, **kwargs: {})
    monkeypatch.setattr(faults, "run_drill", lambda *args: record)
    counted = Counted()
    assert faults.run(5.0, False, ("delay",), counted) == 0
    assert counted.expected == counted.done == len([d for d in faults.drills() if d.kind == "delay"])


def test_bench_papers_counts_its_tables_on_a_terminal(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, shown_at_once: None) -> None:
    terminal = Terminal()
    out = _run(["bench", "papers", "--only", "tutel-fig14", "lina-contention"], terminal, capsys, monkeypatch)
    assert json.loads(out.splitlines()[-1])["summary"] == "papers"
    assert "2/2" in terminal.getvalue() and "table/s" in terminal.getvalue()
