"""Emulated cluster and launcher. Needs root and iproute2; otherwise skipped with the reason."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moeflow.testbed import ClusterError, ClusterSpec, EmulatedCluster, launch, unavailable_reason

REASON = unavailable_reason()
needs_testbed = pytest.mark.skipif(REASON is not None, reason=REASON or "")

RANK_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from datetime import timedelta
    from moeflow.comm.topology import topology_from_environment
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    topology = topology_from_environment(os.environ, world)
    print(f"rank={rank} local={os.environ['LOCAL_RANK']} node={topology.node_of(rank)} "
          f"world={world} sum={int(total.item())} if={os.environ['GLOO_SOCKET_IFNAME']}", flush=True)
    dist.destroy_process_group()
""")


def _our_namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith("mf")}


@needs_testbed
@pytest.mark.slow
def test_launch_runs_every_rank_with_torchrun_environment_and_tears_down() -> None:
    before = _our_namespaces()
    out = io.StringIO()
    code = launch(ClusterSpec(nodes=2, ranks_per_node=2, inter_gbit=1.0), [sys.executable, "-c", RANK_SCRIPT],
                  master_port=29611, timeout_s=120, sink=out)
    assert code == 0, out.getvalue()
    lines = [line for line in out.getvalue().splitlines() if "rank=" in line]
    assert len(lines) == 4
    for rank in range(4):
        line = next(line for line in lines if line.startswith(f"[rank {rank}] "))
        assert f"rank={rank} local={rank % 2} node={rank // 2} world=4 sum=6" in line
    assert _our_namespaces() == before


@needs_testbed
@pytest.mark.slow
def test_a_failing_rank_stops_the_job_with_its_exit_code() -> None:
    script = "import os, sys, time\nif os.environ['RANK'] == '3': sys.exit(7)\ntime.sleep(60)"
    before = _our_namespaces()
    out = io.StringIO()
    start = time.monotonic()
    code = launch(ClusterSpec(nodes=2, ranks_per_node=2), [sys.executable, "-c", script],
                  master_port=29612, timeout_s=120, sink=out)
    assert code == 7
    assert time.monotonic() - start < 30
    assert "rank 3 exited with code 7" in out.getvalue()
    assert not _our_namespaces() - before


@needs_testbed
@pytest.mark.slow
def test_timeout_stops_every_rank() -> None:
    code = launch(ClusterSpec(nodes=1, ranks_per_node=2), [sys.executable, "-c", "import time; time.sleep(60)"],
                  master_port=29613, timeout_s=2, sink=io.StringIO())
    assert code == 124


@needs_testbed
@pytest.mark.slow
def test_inter_node_link_is_shaped_and_intra_node_is_not() -> None:
    """8 MiB over a 1 Gbit/s link needs >= 67 ms. A lower bound only: a busy machine can only make
    it slower, so the test fails only when the link is not shaped."""
    script = textwrap.dedent("""
        import os, time, torch, torch.distributed as dist
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        rank = dist.get_rank()
        data, ack = torch.zeros(2 << 20), torch.zeros(1)
        for peer in (2,):  # the first rank of the other node
            if rank == 0:
                start = time.perf_counter(); dist.send(data, peer); dist.recv(ack, peer)
                print(f"peer{peer}_ms={(time.perf_counter() - start) * 1e3:.1f}", flush=True)
            elif rank == peer:
                dist.recv(data, 0); dist.send(ack, 0)
            dist.barrier()
    """)
    out = io.StringIO()
    code = launch(ClusterSpec(nodes=2, ranks_per_node=2, inter_gbit=1.0), [sys.executable, "-c", script],
                  master_port=29614, timeout_s=120, sink=out)
    assert code == 0, out.getvalue()
    times = dict(part.split("=") for part in out.getvalue().split() if part.startswith("peer"))
    assert float(times["peer2_ms"]) >= 60.0, times


@needs_testbed
def test_every_node_link_carries_the_configured_shaping() -> None:
    with EmulatedCluster(ClusterSpec(nodes=3, ranks_per_node=1, inter_gbit=2.0)) as cluster:
        for node in range(3):
            shown = subprocess.run(
                [*cluster.exec_prefix(node), "tc", "qdisc", "show", "dev", cluster.interface(node)],
                capture_output=True, text=True, check=True,
            ).stdout
            assert ("netem" in shown or "tbf" in shown) and "2Gbit" in shown, shown
        namespaces = set(cluster.info()["namespaces"])
        assert namespaces <= _our_namespaces()
    assert not namespaces & _our_namespaces()


def test_bad_specs_and_missing_root_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="inter_gbit must be > 0"):
        ClusterSpec(nodes=2, ranks_per_node=1, inter_gbit=0)
    with pytest.raises(ValueError, match="exceeds inter_latency_us"):
        ClusterSpec(nodes=2, ranks_per_node=1, inter_latency_us=10, inter_jitter_us=20)
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        EmulatedCluster(ClusterSpec(nodes=2, ranks_per_node=1)).up()


@needs_testbed
def test_cli_launch_and_cleanup() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "launch", "--nodes", "1", "--ranks-per-node", "2", "--master-port", "29615",
         "--", sys.executable, "-c", "import os; print('hello from', os.environ['RANK'])"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "[rank 0] hello from 0" in result.stdout and "[rank 1] hello from 1" in result.stdout
    cleanup = subprocess.run([sys.executable, "-m", "moeflow", "cluster", "--cleanup"],
                             capture_output=True, text=True, timeout=60, check=True)
    assert cleanup.stdout.startswith("deleted ")


def _run_test_module_on_2x2(module: str, master_port: int, timeout_s: float) -> str:
    """Run ``module.run_in_launched_rank()`` (a test module here) as every rank of an emulated 2x2
    cluster; assert that every rank exited 0 and return their output."""
    tests_dir = str(Path(__file__).parent)
    script = f"import sys; sys.path.insert(0, {tests_dir!r}); import {module} as t; t.run_in_launched_rank()"
    out = io.StringIO()
    code = launch(ClusterSpec(nodes=2, ranks_per_node=2, inter_gbit=2.0), [sys.executable, "-c", script],
                  master_port=master_port, timeout_s=timeout_s, sink=out)
    assert code == 0, out.getvalue()
    return out.getvalue()


@needs_testbed
@pytest.mark.slow
def test_alltoall_algorithms_equal_linear_on_the_emulated_2x2_cluster() -> None:
    output = _run_test_module_on_2x2("test_alltoall_algorithms", master_port=29616, timeout_s=180)
    assert output.count("all algorithms equal linear") == 4


@needs_testbed
@pytest.mark.slow
def test_pipeline_equals_degree_one_and_the_reference_on_the_emulated_2x2_cluster() -> None:
    output = _run_test_module_on_2x2("test_pipeline", master_port=29617, timeout_s=300)
    assert output.count("pipeline equals d=1 and the reference") == 4


@needs_testbed
@pytest.mark.slow
def test_bench_pipeline_measures_every_setting_and_summarizes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "bench", "pipeline", "--tokens", "64", "--model-dims", "32",
         "--hidden-dims", "32", "--experts-per-rank", "1", "--top-k", "1", "--repeats", "1",
         "--nodes", "2", "--ranks-per-node", "1", "--profile", _profile_2x1(tmp_path / "profile.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    settings = {r["setting"] for r in records if r.get("bench") == "pipeline"}
    assert settings == {f"d{d}-{a}" for d in (1, 2, 4, 8) for a in ("linear", "pairwise")} | {"model", "auto"}
    assert not any(r.get("bench") == "pipeline-calibration" for r in records)  # the profile given: no calibration
    assert any(r.get("bench") == "pipeline-ideal" and r["ideal_ms"] > 0 for r in records)
    summary = records[-1]
    assert summary["summary"] == "pipeline" and summary["configs"] == 1
    assert 0.0 <= summary["auto"]["share_within_5pct_of_best_fixed"] <= 1.0


@needs_testbed
@pytest.mark.slow
def test_bench_stages_measures_every_schedule_and_the_overlap_side_by_side() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "bench", "stages", "--layers", "4", "--model-dim", "16", "--hidden-dim",
         "16", "--context", "8", "--batch", "8", "--microbatches", "4", "--repeats", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    measured = {r["setting"]: r for r in records if r.get("bench") == "stages"}
    assert set(measured) == {"gpipe", "1f1b", "interleaved", "zbv", "dualpipev", "dualpipev+overlap"}
    assert all(r["step_ms"] > 0 and (r["pp_size"], r["ep_size"]) == (2, 2) for r in measured.values())
    for record in measured.values():  # each stage's costs timed, the schedule priced on them
        assert record["predicted_ms"] > 0 and record["error"] == record["predicted_ms"] / record["step_ms"] - 1
        assert all(forward > 0 for forward in record["stage_ms"]["F"]), record["stage_ms"]
    assert all(pair > 0 for pair in measured["dualpipev+overlap"]["stage_ms"]["pair"])
    assert not any(measured["dualpipev"]["stage_ms"]["pair"])
    summary = records[-1]
    assert summary["summary"] == "stages"
    assert summary["max_prediction_error"] == pytest.approx(max(abs(r["error"]) for r in measured.values()), abs=1e-4)
    (gain,) = summary["overlap_gain"].values()
    assert gain == 1 - measured["dualpipev+overlap"]["step_ms"] / measured["dualpipev"]["step_ms"]


def _profile_2x1(path: Path) -> str:
    """A profile of the benches' default cluster (2 nodes of 1 rank): a bench given it skips the
    calibration (which the first bench_parallel run below does in the cluster)."""
    from moeflow.comm.algorithms import ALGORITHMS
    from moeflow.perf import AlphaBeta, ClusterProfile

    link = AlphaBeta(1e-4, 8e-9)  # 1 Gbit/s
    fits = {**{f"alltoall.{name}": link for name in ALGORITHMS}, "alltoall.inter_node": link,
            **{name: link for name in ("allreduce", "allgather", "reducescatter")}, "gemm": AlphaBeta(1e-6, 1e-10)}
    ClusterProfile(nodes=2, ranks_per_node=1, fits=fits).save(path)
    return str(path)


def _bench_parallel(*flags: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "bench", "parallel", "--hidden-dims", "32", "--model-dim", "32",
         "--tokens", "32", "--capacity-factors", "2", "--repeats", "1", *flags],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@needs_testbed
@pytest.mark.slow
def test_bench_parallel_times_every_r_the_planner_and_parms_schedules(tmp_path: Path) -> None:
    records = _bench_parallel("--num-experts", "1")
    assert any(r.get("bench") == "parallel-calibration" for r in records)  # calibrated in the cluster
    modes = {r["mode"]: r for r in records if r.get("bench") == "parallel"}
    assert set(modes) == {"r0", "r1", "r2", "planner"} and modes["r2"]["r"] == 2
    assert all(r["layer_ms"] > 0 and r["predicted_region_ms"] > 0 for r in modes.values())
    (choice,) = [r for r in records if r.get("bench") == "parallel-choice"]
    assert choice["best_fixed"] in ("r0", "r1", "r2") and choice["planner_r"] in (0, 1, 2)
    assert records[-1]["summary"] == "parallel" and 0 <= records[-1]["planner_within_10pct_share"] <= 1
    records = _bench_parallel("--num-experts", "2", "--mp", "2", "--profile", _profile_2x1(tmp_path / "profile.json"))
    parm = {r["mode"]: r for r in records if r.get("bench") == "parallel"}
    assert set(parm) == {"s1", "s2", "s2-saa", "ds-baseline", "planner"}
    assert parm["s2-saa"]["alltoall"] == "saa" and parm["planner"]["schedule"] in ("s1", "s2")
    (choice,) = [r for r in records if r.get("bench") == "parallel-choice"]
    assert choice["planner_schedule"] in ("s1", "s2")
    assert records[-1]["s1_over_baseline_geomean"] > 0 and records[-1]["s2_over_baseline_geomean"] > 0


@needs_testbed
@pytest.mark.slow
def test_bench_schedules_times_both_schedules_and_records_auto(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "bench", "schedules", "--num-experts", "2", "--hidden-dims", "32",
         "--model-dim", "32", "--batch", "2", "--context", "16", "--repeats", "1",
         "--profile", _profile_2x1(tmp_path / "profile.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    (point,) = [r for r in records if r.get("bench") == "schedules"]
    assert point["expert_step_ms"] > 0 and point["replicated_step_ms"] > 0
    assert point["auto_picked"] in ("expert", "replicated", "adaptive") and point["auto_reason"] == "model"
    assert point["auto_step_ms"] > 0  # auto's own model, timed beside the two
    assert point["expert_degree"] >= 1 and point["expert_alltoall"] in ("linear", "2dh", "pairwise")
    summary = records[-1]
    assert summary["summary"] == "schedules" and summary["configs"] == 1


@needs_testbed
@pytest.mark.slow
def test_bench_alltoall_prints_every_algorithm_and_a_summary() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "bench", "alltoall", "--layouts", "1x2", "--sizes", "1024", "--repeats", "1"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert {line["algorithm"] for line in lines[:-1]} == {"linear", "2dh", "pairwise"}
    assert all(line["ms"] > 0 and line["bytes_per_destination"] == 1024 for line in lines[:-1])
    assert "1x2" in lines[-1]["layouts"] and lines[-1]["summary"] == "alltoall"


@needs_testbed
@pytest.mark.slow
def test_cluster_command_probes_both_links() -> None:
    """`moeflow cluster` runs moeflow.testbed.probe on every rank; rank 0 reports both links."""
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "cluster", "--nodes", "2", "--ranks-per-node", "2", "--inter-gbit", "1",
         "--master-port", "29617"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("[rank 0] {"))[9:])
    assert report["world_size"] == 4 and report["ranks_per_node"] == 2
    assert 0 < report["inter_node"]["gbit_per_s"] < 1.1  # shaped to 1 Gbit/s: never faster
    assert report["intra_node"]["round_trip_us"] > 0


@needs_testbed
@pytest.mark.slow
def test_train_runs_inside_the_emulated_cluster(tmp_path: Path) -> None:
    """`moeflow train` started by `moeflow launch` on 2 emulated nodes: each rank in its namespace."""
    json_package = Path(json.__file__).parent
    flags = ["--data", str(json_package), "--vocab-size", "512", "--context", "32", "--layers", "2", "--heads", "2",
             "--model-dim", "32", "--hidden-dim", "64", "--num-experts", "4", "--batch-size", "4", "--steps", "4",
             "--eval-interval", "2", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    result = subprocess.run(
        [sys.executable, "-m", "moeflow", "launch", "--nodes", "2", "--ranks-per-node", "1", "--master-port", "29619",
         "--timeout", "240", "--", sys.executable, "-m", "moeflow", "train", *flags],
        capture_output=True, text=True, timeout=300, env={**os.environ, "MOEFLOW_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(next(line for line in result.stdout.splitlines() if '{"summary": "train"' in line)
                         .split("] ", 1)[1])
    assert summary["workers"] == 2 and summary["steps"] == 4 and summary["val_loss"] > 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
