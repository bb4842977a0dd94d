"""FasterMoE in `moeflow train`: --shadowing and --gate are checked before any worker starts,
reach every MoE layer of the model the trainer builds, are logged per step in metrics.jsonl, and
the report plots the shadowed experts (FasterMoE's Fig. 11)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from moeflow.comm.groups import ParallelGroups
from moeflow.config import FASTERMOE_REMOTE_SHARE
from moeflow.data import PreparedCorpus, stdlib_directory
from moeflow.perf import AlphaBeta, ClusterProfile
from moeflow.training import TrainConfig
from moeflow.training.launch import run_training
from moeflow.training.metrics import iterate_records
from moeflow.training.report import write_report
from moeflow.training.trainer import build_model

TINY: dict[str, Any] = dict(
    data=str(stdlib_directory() / "json"), vocab_size=512, context=32, layers=2, heads=2, model_dim=32,
    hidden_dim=64, num_experts=4, top_k=2, batch_size=4, steps=2, eval_interval=2, eval_windows=4,
    checkpoint_interval=2, warmup_steps=1, pipeline=1, alltoall="linear", progress=False,
    expert_kernel="bmm",  # runs compared bit for bit: expert_kernel='auto' probes each run's own rates
)


def _profile(path: Path) -> str:
    """A profile whose parameters are nearly free to broadcast and whose token exchange is slow on
    every link (so ``auto`` shadows hot experts), with intra- and inter-node all-to-all fits (so the
    topology gate's ``auto`` finds its share)."""
    fits = {"alltoall.linear": AlphaBeta(1e-4, 1e-6), "allreduce": AlphaBeta(1e-6, 1e-12),
            "gemm": AlphaBeta(1e-6, 1e-9), "alltoall.intra_node": AlphaBeta(1e-5, 1e-6),
            "alltoall.inter_node": AlphaBeta(1e-4, 2e-9)}
    ClusterProfile(nodes=1, ranks_per_node=2, fits=fits).save(path)
    return str(path)


# -- the settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shadowing": "auto"}, "--shadowing auto decides which experts to shadow with FasterMoE's cost model: "
                                "pass --profile"),
        ({"shadowing": "always"}, "unknown shadowing 'always'; choose one of off, auto"),
        ({"topology_gate": "topo"}, "topology_gate must be 'off', 'auto' or the share"),
        ({"topology_gate": "auto"}, "--topology-gate auto takes the share of tokens that may leave a node"),
        ({"shadowing": "auto", "profile": "p.json", "parallel": "replicated"},
         "shadowing replicates hot experts of the expert-parallel schedule; this layer runs "
         "parallel='replicated': use parallel='expert' or shadowing='off'"),
        ({"topology_gate": 0.14, "parallel": 0}, "this layer runs parallel='adaptive'"),
        ({"topology_gate": 0.14, "parallel": "adaptive"}, "runs parallel='adaptive': use parallel='expert' or "
                                                       "topology_gate='off'"),
        ({"topology_gate": 0.14, "workers": 4, "mp_size": 2, "parallel": "s1"},
         "runs parallel='s1': use parallel='expert'"),
    ],
)
def test_bad_fastermoe_settings_name_the_flag_and_the_fix(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**{**TINY, **changes})


def test_the_flags_reach_the_config_and_fail_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moeflow.cli import build_parser, main
    from moeflow.commands.train import train_config_from_args

    args = build_parser().parse_args(["train", "--shadowing", "auto", "--profile", "p.json", "--topology-gate", "auto"])
    config, _ = train_config_from_args(args)
    assert (config.shadowing, config.topology_gate) == ("auto", "auto")
    share = build_parser().parse_args(["train", "--topology-gate", "0.2"])
    assert train_config_from_args(share)[0].topology_gate == 0.2
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--shadowing", "auto"]) == 2
    assert "pass --profile" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_old_gate_setting_still_reads_with_a_warning(tmp_path: Path) -> None:
    from moeflow.cli import build_parser
    from moeflow.commands.train import train_config_from_args
    from moeflow.training.config import checked_keys

    with pytest.warns(FutureWarning, match="renamed topology_gate"):
        config, _ = train_config_from_args(build_parser().parse_args(["train", "--gate", "topology"]))
    assert config.topology_gate == FASTERMOE_REMOTE_SHARE  # no profile: FastMoE's share, as --gate topology did
    with pytest.warns(FutureWarning):
        saved = checked_keys({"gate": "topology", "profile": "p.json"}, "checkpoint")  # a saved run's config
    assert saved == {"topology_gate": "auto", "profile": "p.json"}
    with pytest.warns(FutureWarning):
        assert checked_keys({"gate": "plain"}) == {}
    with pytest.raises(ValueError, match="unknown gate 'topo'"):
        checked_keys({"gate": "topo"})


def _corpus() -> PreparedCorpus:
    return PreparedCorpus("unused", "unused", "bpe", 512, 1, 1, 1, 1, 1.0, 1.0)


@pytest.mark.parametrize("with_profile", [False, True])
def test_every_moe_layer_of_the_trainers_model_gets_the_settings(tmp_path: Path, with_profile: bool) -> None:
    profile = _profile(tmp_path / "profile.json") if with_profile else None
    changes = {"shadowing": "auto"} if with_profile else {}
    share = "auto" if with_profile else FASTERMOE_REMOTE_SHARE
    config = TrainConfig(**{**TINY, "moe_every": 1, "topology_gate": share, "profile": profile, **changes})
    model = build_model(config, _corpus(), ParallelGroups.from_group(None), torch.device("cpu"))
    layers = model.moe_layers()
    assert len(layers) == 2
    assert all(layer.config.topology_gate == share and layer.node_limit is not None for layer in layers)
    assert all(layer.config.shadowing == ("auto" if with_profile else "off") for layer in layers)
    plain = build_model(TrainConfig(**TINY), _corpus(), ParallelGroups.from_group(None), torch.device("cpu"))
    assert all(layer.config.topology_gate == "off" and layer.config.shadowing == "off" for layer in plain.moe_layers())


# -- the report ----------------------------------------------------------------------------------


def _record(step: int, shadowed: dict[int, list[int]]) -> dict[str, Any]:
    """One metrics.jsonl line as the trainer writes it, for blocks 0 and 1 of 4 experts."""
    moe = [{"block": block, "tokens_per_expert": [40, 10, 6, 8], "dropped": 0, "capacity": 20, "alltoall": "linear",
            "pipeline_degree": 1, "plan_source": "forced", "schedule": "expert", "r": None,
            "shadowed": shadowed.get(block, []), "shadow_gain_s": 1e-4 if shadowed.get(block) else 0.0}
           for block in (0, 1)]
    return {"step": step, "loss": 5.0 - 0.1 * step, "aux_loss": 0.01, "lr": 1e-3, "grad_norm": 1.0,
            "tokens_per_s": 1000.0, "step_s": 0.1, "tokens_seen": 256 * step,
            "time_s": {"attention": 0.01, "experts": 0.02, "all_to_all": 0.01}, "moe": moe}


def _write_metrics(run_dir: Path, records: list[dict[str, Any]]) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_plots_the_shadowed_experts_and_counts_the_steps(tmp_path: Path) -> None:
    shadowed = {1: {0: [0]}, 2: {0: [0], 1: [0, 2]}, 4: {1: [3]}}  # step -> block -> experts
    _write_metrics(tmp_path / "run", [_record(step, shadowed.get(step, {})) for step in range(1, 7)])
    summary = write_report(tmp_path / "run")
    assert summary["shadowed_steps"] == 3
    assert (tmp_path / "run" / "shadowed_experts.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["shadowed_steps"] == 3


def test_report_without_shadowing_writes_no_shadow_plot(tmp_path: Path) -> None:
    records = [_record(step, {}) for step in range(1, 4)]
    for record in records[:2]:  # a run from before the shadowing keys
        for layer in record["moe"]:
            del layer["shadowed"], layer["shadow_gain_s"]
    _write_metrics(tmp_path / "run", records)
    assert write_report(tmp_path / "run")["shadowed_steps"] == 0
    assert not (tmp_path / "run" / "shadowed_experts.png").exists()
    assert (tmp_path / "run" / "expert_load.png").exists()


# -- a short run ---------------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_workers_train_with_shadowing_and_the_topology_gate_and_report_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = {**TINY, "run_dir": str(run_dir), "topology_gate": "auto", "shadowing": "auto", "parallel": "expert",
              "profile": _profile(tmp_path / "profile.json")}
    run_training(TrainConfig(**config))
    records = list(iterate_records(run_dir))
    assert [r["step"] for r in records] == [1, 2]
    layers = [layer for r in records for layer in r["moe"]]
    assert all(layer["schedule"] == "expert" and isinstance(layer["shadow_gain_s"], float) for layer in layers)
    assert all(set(layer["shadowed"]) <= set(range(4)) for layer in layers)
    shadowing_steps = sum(any(layer["shadowed"] for layer in r["moe"]) for r in records)
    assert shadowing_steps >= 1  # broadcasting parameters is nearly free on this profile
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["shadowing"], saved["topology_gate"]) == ("auto", "auto")
    assert json.loads((run_dir / "summary.json").read_text())["shadowed_steps"] == shadowing_steps
    assert (run_dir / "shadowed_experts.png").exists()


@pytest.mark.distributed
def test_redundant_experts_rebalance_every_step_and_resume_exactly(tmp_path: Path) -> None:
    from moeflow.cli import main

    settings = {**TINY, "steps": 4, "parallel": "expert", "redundant_experts": 2, "rebalance_interval": 1,
                "rebalance_window": 2}
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "whole")), report=False)
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "resumed"), stop_at=2), report=False)
    state = json.loads(next((tmp_path / "resumed" / "checkpoints").glob("step-000002/state.json")).read_text())
    assert len(state["rebalancer"]["history"]["0"]) == 2  # the window travels with the checkpoint
    assert main(["train", "--resume", str(tmp_path / "resumed")]) == 0
    whole, resumed = list(iterate_records(tmp_path / "whole")), list(iterate_records(tmp_path / "resumed"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # bit for bit across the rebalances
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in whole]
    assert any(r["rebalanced_blocks"] for r in whole)  # the slots did move
    for record in whole:
        for layer in record["moe"]:
            assert sum(layer["rank_tokens"]) == sum(layer["tokens_per_expert"]) - layer["dropped"]


@pytest.mark.distributed
def test_balance_auto_chooses_per_block_and_resumes_exactly(tmp_path: Path) -> None:
    from moeflow.cli import main

    settings = {**TINY, "steps": 4, "parallel": "expert", "redundant_experts": 2, "balance": "auto",
                "rebalance_interval": 1, "rebalance_window": 2, "profile": _profile(tmp_path / "profile.json")}
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "whole")), report=False)
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "resumed"), stop_at=2), report=False)
    assert main(["train", "--resume", str(tmp_path / "resumed")]) == 0
    whole, resumed = list(iterate_records(tmp_path / "whole")), list(iterate_records(tmp_path / "resumed"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # bit for bit across the choices
    assert [[b["balance"] for b in r["moe"]] for r in resumed] == [[b["balance"] for b in r["moe"]] for r in whole]
    assert whole[0]["moe"][0]["balance"] == "off"  # expert parallelism until the first rebalance
    assert {b["balance"] for r in whole[1:] for b in r["moe"]} - {"off"}  # the cheap profile's choice balances


def test_redundant_slots_must_fit_the_workers() -> None:
    with pytest.raises(ValueError, match="multiple of 2"):
        TrainConfig(**{**TINY, "parallel": "expert", "redundant_experts": 1})
