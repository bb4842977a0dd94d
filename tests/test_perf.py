"""Performance models: fits, profiles, cost functions and FasterMoE's busiest link (plain math)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moeflow.config import LayerDims
from moeflow.core.capacity import expert_capacity
from moeflow.perf import (
    AlphaBeta,
    ClusterProfile,
    CostModel,
    communication_latency,
    fit_alpha_beta,
    link_loads,
    median_relative_error,
)
from moeflow.perf.profile import NOT_MEASURED, ProfileDevice, median_profile
from moeflow.perf.shape import RegionShape


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_fit_recovers_an_exact_line_and_scores_noise_lower() -> None:
    xs = [1e3, 2e3, 4e3, 8e3]
    exact = fit_alpha_beta(xs, [0.5 + 0.001 * x for x in xs])
    assert exact.alpha == pytest.approx(0.5) and exact.beta == pytest.approx(0.001) and exact.r2 == pytest.approx(1)
    noisy = fit_alpha_beta(xs, [1.6, 2.3, 4.9, 8.4])
    assert 0.9 < noisy.r2 < 1.0
    through_origin = fit_alpha_beta([1, 2, 3], [0.5, 2.0, 3.2])  # negative intercept -> clamped
    assert through_origin.alpha == 0.0 and through_origin.beta > 0
    with pytest.raises(ValueError, match="two distinct x"):
        fit_alpha_beta([1, 1], [1, 2])
    assert median_relative_error(AlphaBeta(0.0, 1.0), [1, 2, 4], [1.1, 2.0, 4.0]) == pytest.approx(0.0)


def test_topology_aware_traffic_and_latency() -> None:
    # 2 nodes x 2 ranks; rank 0 sends 10 to rank 1 (same node) and 100 to rank 2 (other node)
    matrix = np.array([[0, 10, 100, 0], [0, 0, 0, 0], [0, 0, 0, 0], [50, 0, 0, 0]], dtype=float)
    up, down, local = link_loads(matrix, ranks_per_node=2)
    assert up.tolist() == [100, 50] and down.tolist() == [50, 100] and local.tolist() == [10, 0, 0, 0]
    assert communication_latency(matrix, 2, inter_s_per_byte=0.1, intra_s_per_byte=0.01) == 10.0


def _profile() -> ClusterProfile:
    fits = {
        "gemm": AlphaBeta(0.0, 1e-9), "alltoall.linear": AlphaBeta(1e-3, 1e-8), "alltoall.2dh": AlphaBeta(2e-3, 1e-8),
        "allreduce": AlphaBeta(1e-3, 2e-8), "allgather": AlphaBeta(1e-3, 1e-8),
    }
    return ClusterProfile(nodes=2, ranks_per_node=2, fits=fits, interference=1.2)


def test_cost_model_composes_the_fits() -> None:
    model = CostModel(_profile())
    shape = RegionShape.for_tokens(LayerDims(model_dim=64, hidden_dim=128, num_experts=8, top_k=2), tokens=1024)
    assert shape.capacity == 256
    # 2 local experts x 2 GEMMs of (4 ranks * 256 rows) x 64 x 128
    assert model.t_expert(shape) == pytest.approx(2 * 2 * 1e-9 * (4 * 256) * 64 * 128)
    assert model.t_expert(shape, backward=True, overlapped=True) == pytest.approx(3 * 1.2 * model.t_expert(shape))
    assert model.dispatch_bytes(shape) == 8 * 256 * 64 * 4
    times = model.layer_times(shape, "linear")
    assert times["communicate_s"] == pytest.approx(4 * (1e-3 + 1e-8 * model.dispatch_bytes(shape)))
    assert times["serial_s"] == pytest.approx(times["compute_s"] + times["communicate_s"])
    with pytest.raises(KeyError, match=r"no fit for 'alltoall\.pairwise'"):
        model.t_alltoall("pairwise", 10)


def test_profile_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "profile.json"
    _profile().save(path)
    assert ClusterProfile.load(path) == _profile()
    assert not list(path.parent.glob("*.tmp"))  # atomic write leaves no temporary behind
    stale = json.loads(path.read_text()) | {"version": 0}
    path.write_text(json.dumps(stale))
    with pytest.raises(ValueError, match="re-run moeflow calibrate"):
        ClusterProfile.load(path)
    with pytest.raises(FileNotFoundError, match="moeflow calibrate --out"):
        ClusterProfile.load(tmp_path / "missing.json")


def test_profile_records_the_device_and_older_profiles_load_as_cpu(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    gpu = ProfileDevice(kind="cuda", name="NVIDIA H200", dtype="bf16", collectives=NOT_MEASURED)
    profile = ClusterProfile(nodes=1, ranks_per_node=1, fits={"gemm": AlphaBeta(0.0, 1e-12)}, device=gpu)
    profile.save(path)
    assert json.loads(path.read_text())["device"] == {"kind": "cuda", "name": "NVIDIA H200", "dtype": "bf16",
                                                      "collectives": NOT_MEASURED}
    assert ClusterProfile.load(path) == profile and ClusterProfile.load(path).device.label() == "cuda (NVIDIA H200)"
    older = json.loads(path.read_text())  # a profile saved before the device was recorded: same version
    del older["device"]
    path.write_text(json.dumps(older))
    assert ClusterProfile.load(path).device == ProfileDevice("cpu", "cpu", "fp32", NOT_MEASURED)  # one rank
    _profile().save(path)
    older = json.loads(path.read_text())
    del older["device"]
    path.write_text(json.dumps(older))
    assert ClusterProfile.load(path).device == ProfileDevice("cpu", "cpu", "fp32", "gloo")  # 4 ranks over gloo
    with pytest.raises(ValueError, match="different devices"):
        median_profile([_profile(), ClusterProfile(2, 2, _profile().fits, device=gpu)])
    assert median_profile([profile, profile]).device == gpu


@pytest.mark.skipif(torch_cuda_available(), reason="checks the error of a machine without CUDA")
def test_calibrate_on_cuda_without_cuda_says_so_and_how_to_fix(tmp_path: Path) -> None:
    from moeflow.cli import main

    with pytest.raises(SystemExit, match=r"moeflow calibrate: --device cuda: no CUDA device .* --device cpu"):
        main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "profile.json")])
    assert not (tmp_path / "profile.json").exists()


def test_calibrate_on_cuda_runs_one_process_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA (stood in for here): several local workers are refused, naming torchrun."""
    import torch
    import torch.distributed as dist

    from moeflow.commands.calibrate import cuda_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert cuda_problem(launched=False, workers=None) is None and cuda_problem(launched=True, workers=4) is None
    assert "torchrun --nproc-per-node 2 -m moeflow calibrate --device cuda" in cuda_problem(launched=False, workers=2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert "no NCCL" in cuda_problem(launched=False, workers=None)


def test_calibration_config_names_bad_devices_and_dtypes() -> None:
    from moeflow.calibrate import CalibrationConfig

    with pytest.raises(ValueError, match="cpu or cuda"):
        CalibrationConfig(device="mps")
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        CalibrationConfig(dtype="fp8")


def test_perf_and_the_planner_import_numpy_only() -> None:
    """The cost models and the planner are plain math: importing them loads no torch at all."""
    probe = (
        "import sys, moeflow.perf, moeflow.perf.schedule_models, moeflow.perf.shadowing, "
        "moeflow.parallel.online_planner, "
        "moeflow.core.capacity; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]"


@pytest.mark.parametrize("factor", [-2.0, -1.5, -0.5, 0.0, 0.5, 1.0, 1.1, 1.25, 2.0])
def test_perf_plans_with_the_capacity_the_layer_runs(factor: float) -> None:
    """RegionShape.for_tokens and the layer's rule agree on capacity over a grid of (f, k, T, E) (the
    layer's own value is what its stats report after a forward with the same load)."""
    for top_k, tokens, experts in itertools.product((1, 2, 3), (0, 1, 15, 64, 1000), (3, 4, 8)):
        if top_k > experts:
            continue
        needed = -(-top_k * tokens // experts) + (3 if tokens else 0)  # a load above the balanced one
        shape = RegionShape.for_tokens(LayerDims(8, 16, experts, top_k), tokens, factor, needed=needed)
        assert shape.capacity == expert_capacity(factor, top_k, tokens, experts, needed)
        assert (shape.tokens, shape.needed) == (tokens, needed)
    # the example of the issue: k=1, f=1.1, T=15, E=4 is 5 slots (ceil(16.5 / 4)), not 4
    assert RegionShape.for_tokens(LayerDims(8, 16, 4, top_k=1), 15, capacity_factor=1.1).capacity == 5
    # at f = 0 without a measured load, the planner assumes the balanced one, not 1 (and records none)
    balanced = RegionShape.for_tokens(LayerDims(8, 16, 8, top_k=2), 1024, capacity_factor=0.0)
    assert (balanced.capacity, balanced.needed) == (256, 0)


def test_layer_capacity_matches_perf_after_a_forward() -> None:
    import torch

    from moeflow import MoELayer

    for factor in (-1.5, 0.0, 0.5, 1.1):
        layer = MoELayer(8, 16, 4, top_k=1, capacity_factor=factor)
        layer(torch.randn(15, 8, generator=torch.Generator().manual_seed(3)))
        stats = layer.last_stats
        assert stats is not None
        needed = max(stats.tokens_per_expert)
        assert stats.capacity == RegionShape.for_tokens(LayerDims(8, 16, 4, 1), 15, factor, needed=needed).capacity


@pytest.mark.distributed
def test_calibrate_on_two_workers_writes_a_usable_profile(tmp_path: Path) -> None:
    from moeflow.calibrate import CalibrationConfig, calibrate_rank
    from pool import run_distributed

    config = CalibrationConfig(model_dim=32, hidden_dim=64, gemm_tokens=(64, 128, 256, 512),
                               collective_bytes=(4096, 16384, 65536, 262144), repeats=1, layer_repeats=1)
    profile_dict = run_distributed(calibrate_rank, 2, config, timeout_s=300)[0]
    profile = ClusterProfile.from_dict(profile_dict)
    assert set(profile.fits) == {"gemm", "alltoall.linear", "alltoall.2dh", "alltoall.pairwise", "allreduce",
                                 "allgather", "reducescatter", "alltoall.intra_node",  # one node: no inter-node
                                 "allgather.intra_node", "alltoall.saa", "ffn.forward", "ffn.backward",
                                 "encode", "decode", "layer.forward", "layer.backward", "layer.pipelined"}
    assert profile.device == ProfileDevice("cpu", "cpu", "fp32", "gloo")
    assert profile.interference >= 1.0 and profile.nodes * profile.ranks_per_node == 2
    assert all(report["points"] >= 4 and report["r2"] <= 1.0 for report in profile.quality["fits"])
    assert CostModel(profile).layer_times(RegionShape.for_tokens(LayerDims(32, 64, 4), 256))["serial_s"] > 0


def test_plan_cli_prints_predictions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.cli import main

    path = tmp_path / "profile.json"
    _profile().save(path)
    assert main(["plan", "--profile", str(path), "--tokens", "1024", "--num-experts", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {line["alltoall"] for line in lines[:-1] if "alltoall" in line} == {"linear", "2dh"}  # no pairwise fit
    per_degree = [line for line in lines if line.get("plan") == "pipeline"]
    assert {(line["alltoall"], line["degree"]) for line in per_degree} == {
        (a, d) for a in ("linear", "2dh") for d in range(1, 17)}
    assert not [line for line in lines if line.get("plan") == "theorem1"]  # Theorem 1 is the tests' oracle only
    summary = lines[-1]
    fastest = min(per_degree, key=lambda line: line["total_ms"])
    assert summary["summary"] == "plan" and (summary["alltoall"], summary["degree"]) == (
        fastest["alltoall"], fastest["degree"])
    assert summary["predicted_ms"] <= summary["predicted_d1_ms"]
    assert not {"r_cc", "ideal_ms", "semi_ideal_ms"} & set(summary)  # the roofline decides nothing: not printed
    (replicated,) = [line for line in lines if line.get("plan") == "replicated"]
    # every rank runs all 8 experts on its own 256 slots each; training adds the gradient all-reduce
    assert replicated["gradient_sync_ms"] > 0
    assert replicated["expert_memory_mb"] == pytest.approx(4 * summary["expert_memory_mb"], rel=1e-3)
    expected = "replicated" if replicated["total_ms"] < summary["predicted_ms"] else "expert"
    assert summary["schedule"] == expected
    with pytest.raises(SystemExit, match="moeflow calibrate --out"):
        main(["plan", "--profile", str(tmp_path / "none.json")])


def test_plan_cli_prints_every_tutel_r_with_more_ranks_than_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moeflow.cli import main

    profile = _profile()
    fits = {**profile.fits, "reducescatter": AlphaBeta(1e-3, 1e-8)}
    path = tmp_path / "profile.json"
    ClusterProfile(nodes=2, ranks_per_node=2, fits=fits, interference=1.2).save(path)
    with pytest.warns(FutureWarning, match="--experts is renamed --num-experts"):  # the old spelling still reads
        assert main(["plan", "--profile", str(path), "--tokens", "1024", "--experts", "2", "--top-k", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    adaptive = [line for line in lines if line.get("plan") == "adaptive"]
    assert [line["r"] for line in adaptive] == [0, 1, 2]  # W / E = 2 hidden shards per expert
    assert adaptive[0]["alltoall"] == "none" and adaptive[0]["degree"] == 1
    (summary,) = [line for line in lines if line.get("summary") == "plan-adaptive"]
    assert summary["predicted_ms"] == pytest.approx(min(line["total_ms"] for line in adaptive), rel=1e-3)
    assert not any(line.get("plan") == "pipeline" for line in lines)  # 2 experts do not split over 4 ranks


def test_plan_cli_prints_parms_modes_behind_mp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.cli import main

    profile = _profile()
    fits = {**profile.fits, "allgather": AlphaBeta(1e-3, 1e-8), "allreduce": AlphaBeta(1e-3, 2e-8),
            "alltoall.saa": AlphaBeta(1e-3, 1.5e-8)}
    path = tmp_path / "profile.json"
    ClusterProfile(nodes=2, ranks_per_node=2, fits=fits, interference=1.2).save(path)
    argv = ["plan", "--profile", str(path), "--tokens", "1024", "--num-experts", "4", "--top-k", "1", "--mp", "2"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    modes = {(line["schedule"], line["alltoall"]): line for line in lines if line.get("plan") == "parm"}
    assert set(modes) == {("ds-baseline", "linear"), ("s1", "linear"), ("s2", "linear"), ("s2", "saa")}
    parm = [line["total_ms"] for mode, line in modes.items() if mode[0] != "ds-baseline"]
    assert max(parm) < modes["ds-baseline", "linear"]["total_ms"]
    summary = lines[-1]
    assert summary["summary"] == "plan-parm" and summary["algorithm1"] in ("s1", "s2")
    assert summary["predicted_ms"] == pytest.approx(min(parm), rel=1e-3)
    with pytest.raises(SystemExit, match="--mp 3 and --esp 3 must divide"):
        main([*argv[:-1], "3"])
    assert main([*argv, "--esp", "4"]) == 0  # N_ESP = 4 behind N_MP = 2: S1 and S2, no baseline
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    wider = {(line["schedule"], line["alltoall"]): line for line in lines if line.get("plan") == "parm"}
    assert set(wider) == {("s1", "linear"), ("s2", "linear"), ("s2", "saa")} and lines[-1]["esp"] == 4
    assert wider["s2", "linear"]["total_ms"] > modes["s2", "linear"]["total_ms"]  # twice the dumped slots


def test_expert_ffn_time_comes_from_its_own_fits_or_from_the_gemm() -> None:
    """Without the calibrated FFN fits: projections GEMMs forward, twice that backward; with them,
    the fits at x = rows * M * H * projections."""
    plain = CostModel(_profile())
    forward = plain.t_ffn(128, 64, 256, 2)
    assert forward == pytest.approx(2 * plain.t_gemm(128, 64, 256))
    assert plain.t_ffn(128, 64, 256, 2, backward=True) == pytest.approx(2 * forward)
    fits = {**_profile().fits, "ffn.forward": AlphaBeta(1e-3, 1e-10), "ffn.backward": AlphaBeta(2e-3, 3e-10)}
    calibrated = CostModel(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits))
    assert calibrated.t_ffn(128, 64, 256, 3) == pytest.approx(1e-3 + 1e-10 * 128 * 64 * 256 * 3)
    assert calibrated.t_ffn(128, 64, 256, 3, backward=True) == pytest.approx(2e-3 + 3e-10 * 128 * 64 * 256 * 3)


def test_plan_cli_prices_shadowing_and_redundant_slots_at_a_skew(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moeflow.cli import main

    path = tmp_path / "profile.json"
    _profile().save(path)
    common = ["plan", "--profile", str(path), "--tokens", "1024", "--num-experts", "8", "--top-k", "1"]

    def skew_line(skew: str) -> dict[str, Any]:
        assert main([*common, "--skew", skew]) == 0
        (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"skew"' in x]
        return line

    one_hot, uniform = skew_line("one-hot"), skew_line("uniform")
    assert one_hot["tokens_per_expert"] == [4096.0] + [0.0] * 7 and one_hot["max_over_mean_load"] == 4.0
    assert one_hot["redundant_max_over_mean_load"] == pytest.approx(1.0)  # a copy of expert 0 on each rank
    assert (one_hot["shadowed"] == [0]) == (one_hot["predicted_gain_ms"] > 0)
    gain = one_hot["latency_ms"] - one_hot["shadowed_latency_ms"]  # printed to 4 significant digits
    assert one_hot["predicted_gain_ms"] == pytest.approx(gain, abs=1e-3 * one_hot["latency_ms"])
    assert uniform["shadowed"] == [] and uniform["predicted_gain_ms"] == 0.0  # nothing to gain at even load
    with pytest.raises(SystemExit, match="--skew: unknown skew"):
        main([*common, "--skew", "zipfian"])


@pytest.mark.parametrize(("activation", "bias"), [("gelu", True), ("swiglu", False), ("swiglu", True)])
def test_a_layers_dims_count_its_own_expert_parameters(activation: str, bias: bool) -> None:
    """LayerDims, the one shape type the cost models and the simulator read, counts one expert's
    parameters as the layer holds them (the planner's memory figures and the simulator's gradient
    bytes rest on it)."""
    from moeflow import MoELayer
    from moeflow.config import MoEConfig

    config = MoEConfig(model_dim=8, hidden_dim=16, num_experts=4, top_k=2, activation=activation, bias=bias)
    layer = MoELayer(config)
    held = sum(p.numel() for name, p in layer.named_parameters() if name.startswith("experts."))
    assert config.dims == LayerDims(8, 16, 4, 2, 3 if activation == "swiglu" else 2, bias)
    assert config.dims.expert_parameters * config.num_experts == held
    with pytest.raises(ValueError, match="top_k=5 is larger than num_experts=4"):
        LayerDims(8, 16, 4, top_k=5)
