"""The planner runs what it plans: the joint planner chooses the expert group size, ``moeflow plan
--out`` writes a plan file of ``moeflow train``'s settings, and ``moeflow train --plan`` runs it with
the prediction beside the measured step time in ``summary.json``."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from moeflow.cli import main
from moeflow.config import LayerDims
from moeflow.perf.sim.cluster import Cluster, Device, Link
from moeflow.perf.sim.network import Network, Transfer
from moeflow.perf.sim.workload import ModelSpec
from moeflow.sim import StepPlan, simulate_step
from moeflow.sim.planner import SearchSpace, candidate_plans, expert_group_sizes, search
from moeflow.training import TrainConfig
from moeflow.training.config import load_config_file
from moeflow.training.plan_file import (
    model_of_config,
    plan_settings,
    read_plan_file,
    settings_of_model,
    write_plan_file,
)

PROFILE = Path(__file__).parent / "data" / "sim_validation" / "profile-2x1-1gbit.json"
TINY_MODEL = ModelSpec("tiny", 2, LayerDims(256, 512, 8, 2, bias=False), 1.0, 512, 128, "fp32")


def cluster(nodes: int = 2, per_node: int = 4, nic_gbit: float = 100.0) -> Cluster:
    device = Device("gpu", 100e12, 5e-6, 1e12)
    return Cluster("test", nodes, per_node, device, Link(100e9, 2e-6, 1e-6), Link(nic_gbit * 1e9 / 8, 5e-6, 2e-6))


def test_an_expert_group_inside_a_node_sends_nothing_over_the_nics_and_syncs_its_copies() -> None:
    whole = simulate_step(cluster(), TINY_MODEL, StepPlan())
    assert simulate_step(cluster(), TINY_MODEL, StepPlan(ep=8)).step_s == whole.step_s  # ep = world: unchanged
    grouped = simulate_step(cluster(), TINY_MODEL, StepPlan(ep=4))
    assert "allreduce-experts" in grouped.busy_s and "allreduce-experts" not in whole.busy_s
    slow = simulate_step(cluster(nic_gbit=1.0), TINY_MODEL, StepPlan(ep=4, bucket_mb=math.inf))
    fast = simulate_step(cluster(nic_gbit=1.0), TINY_MODEL, StepPlan(ep=4, bucket_mb=math.inf), layer_only=True)
    assert fast.busy_s["alltoall"] == pytest.approx(grouped.busy_s["alltoall"], rel=0.5)  # intra-node links only
    assert slow.busy_s["allreduce-experts"] > grouped.busy_s["allreduce-experts"]  # the copies sync over the NICs


def test_a_strided_allreduce_over_every_rank_is_the_worlds_and_groups_across_nodes_use_the_nics() -> None:
    network = Network(cluster())
    world = network.allreduce(1e6, "ring")[0]
    assert isinstance(world, Transfer)
    (strided,) = network.strided_allreduce(1e6, 1)
    assert strided.alone_s == pytest.approx(world.alone_s)
    (across,) = network.strided_allreduce(1e6, 4)  # pairs of ranks, one in each node
    w = network.world
    assert across.work[:2 * w].max() == 0 and across.work[2 * w:].max() > 0
    assert network.strided_allreduce(1e6, 8) == []  # one copy: nothing to reduce


def test_expert_groups_tile_the_nodes_and_replicating_schedules_take_none() -> None:
    assert expert_group_sizes(cluster()) == [8, 4, 2, 1]
    assert expert_group_sizes(cluster(4, 2)) == [8, 4, 2, 1]
    assert expert_group_sizes(cluster(3, 4)) == [12, 4, 2, 1]  # 6 splits a node
    with pytest.raises(ValueError, match="tile the nodes"):
        simulate_step(cluster(3, 4), TINY_MODEL.with_overrides(num_experts=12), StepPlan(ep=6))
    with pytest.raises(ValueError, match="leave ep unset"):
        simulate_step(cluster(), TINY_MODEL, StepPlan("replicated", ep=4))
    with pytest.raises(ValueError, match="do not tile"):
        candidate_plans(cluster(), TINY_MODEL, SearchSpace(ep_sizes=(3,)))


def test_the_planner_chooses_the_layout_by_the_links() -> None:
    """Slow NICs: expert groups inside a node win (only the copies' sync crosses the NICs, once per
    step); fast ones: every rank in one group (no copies to sync, the fewest experts per rank)."""
    model = TINY_MODEL.with_overrides(tokens_per_rank=8192, layers=1)
    slow = search(cluster(nic_gbit=0.5), model, top=1)[0]
    fast = search(cluster(nic_gbit=4000.0), model.with_overrides(hidden_dim=8192), top=1)[0]
    assert slow.plan.ep == 4, slow.plan
    assert fast.plan.ep is None, fast.plan


def test_plan_settings_name_train_settings_for_each_schedule() -> None:
    c = cluster()
    expert = plan_settings(StepPlan(degree=2, algorithm="2dh", ep=4, shadowed=1, bucket_mb=math.inf), c)
    assert expert == {"workers": 8, "ranks_per_node": 4, "ep_size": 4, "parallel": "expert", "pipeline": 2,
                           "alltoall": "2dh", "token_exchange": "padded", "wire_dtype": "exact", "shadowing": "auto",
                           "redundant_experts": 0, "balance": "fixed", "expert_packing": "off", "grad_sync": "after",
                      "pp_size": 1}  # no pipeline: a base config's pp_size is the plan's to decide
    assert plan_settings(StepPlan(wire_dtype="fp8"), c)["wire_dtype"] == "fp8"  # what the plan was priced in
    assert plan_settings(StepPlan("adaptive", r=2, bucket_mb=1.0), c)["parallel"] == 2
    assert plan_settings(StepPlan("smart"), c).items() >= {"parallel": "expert", "pipeline": "smart"}.items()
    s2 = plan_settings(StepPlan("s2", 2, mp=2, esp=2, prioritize_alltoall=True), c)
    assert s2.items() >= {"parallel": "s2", "alltoall": "saa", "mp_size": 2, "esp_size": 2, "grad_sync": "lina"}.items()
    assert plan_settings(StepPlan("replicated"), c)["parallel"] == "replicated"
    for plan in (StepPlan(degree=2, ep=4), StepPlan("adaptive", r=1), StepPlan("smart")):
        TrainConfig(**{**settings_of_model(TINY_MODEL), **plan_settings(plan, c)})  # moeflow train accepts them


def test_a_train_config_and_a_model_file_describe_the_same_model() -> None:
    config = TrainConfig(**settings_of_model(TINY_MODEL), vocab_size=512)
    model = model_of_config(config)
    assert model.dims.model_dim == 256 and model.dims.num_experts == 8 and model.tokens_per_rank == 512
    assert model.sequence_length == 128 and model.vocab_size == 512 and model.layers == 2
    with pytest.raises(ValueError, match="moe_every = 1"):
        model_of_config(replace(config, moe_every=2))
    with pytest.raises(ValueError, match="multiple of sequence_length"):
        settings_of_model(TINY_MODEL.with_overrides(tokens_per_rank=500))


def test_a_plan_file_round_trips_and_is_refused_as_a_plain_config(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    write_plan_file(path, {"workers": 2, "parallel": "expert", "bucket_mb": 1.5, "profile": None},
                    {"label": "expert d=1", "predicted_step_ms": 12.5, "fixed": ["workers"],
                     "runner_up": {"label": "x \"quoted\"", "predicted_step_ms": 13.0}}, "a header\nline two")
    settings, table = read_plan_file(str(path))
    assert settings == {"workers": 2, "parallel": "expert", "bucket_mb": 1.5}
    assert table["runner_up"]["label"] == 'x "quoted"' and table["predicted_step_ms"] == 12.5
    with pytest.raises(ValueError, match="pass it as --plan"):
        load_config_file(str(path))
    (tmp_path / "plain.toml").write_text("workers = 2\n")
    with pytest.raises(ValueError, match="no \\[plan\\] table"):
        read_plan_file(str(tmp_path / "plain.toml"))
    with pytest.raises(FileNotFoundError, match="moeflow plan --out"):
        read_plan_file(str(tmp_path / "missing.toml"))


def test_moeflow_plan_writes_what_train_runs_and_the_summary_measures_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_training import TINY

    config = tmp_path / "tiny.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {**TINY, "steps": 6}.items()))
    plan = tmp_path / "plan.toml"
    assert main(["plan", "--profile", str(PROFILE), "--config", str(config), "--out", str(plan), "--top", "2"]) == 0
    printed = capsys.readouterr().out
    settings, table = read_plan_file(str(plan))
    assert f"wrote {plan}" in printed and table["label"] in printed and table["predicted_step_ms"] > 0
    assert settings["workers"] == 2 and settings["steps"] == 6 and settings["profile"] == str(PROFILE)
    assert "runner_up" in table and "workers" in table["fixed"]
    run_dir = tmp_path / "run"
    assert main(["train", "--plan", str(plan), "--run-dir", str(run_dir)]) == 0
    whole = json.loads((run_dir / "summary.json").read_text())
    summary, excluded = whole["plan"], {step for steps in whole["excluded_steps"].values() for step in steps}
    assert summary["label"] == table["label"] and summary["predicted_step_ms"] == table["predicted_step_ms"]
    assert 1 in excluded and summary["steps_measured"] == 6 - len(excluded)  # the report's steady steps
    assert summary["measured_step_ms"] > 0
    ran = json.loads((run_dir / "config.json").read_text())
    assert all(ran[key] == value for key, value in settings.items() if key != "data")


def test_the_twin_charges_each_chunk_what_the_pipelined_probe_measured_beyond_its_own_prediction() -> None:
    from moeflow.perf import AlphaBeta, ClusterProfile
    from moeflow.sim.calibrated import cluster_from_profile, fitted_chunk_cost

    recorded = ClusterProfile.load(PROFILE)
    profile = replace(recorded, fits={k: v for k, v in recorded.fits.items() if k != "layer.pipelined"})
    plain = cluster_from_profile(profile)
    assert plain.device.chunk_s == 0.0  # a profile without the probe's fit
    flat = replace(profile, fits={**profile.fits, "layer.pipelined": AlphaBeta(0.2, 0.0)})
    costly = replace(profile, fits={**profile.fits, "layer.pipelined": AlphaBeta(0.2, 0.03)})
    assert fitted_chunk_cost(plain, costly) > fitted_chunk_cost(plain, flat) >= 0.0
    twin = cluster_from_profile(costly)
    assert twin.device.chunk_s == pytest.approx(fitted_chunk_cost(plain, costly)) and "device.chunk" in twin.sources
    model = TINY_MODEL.with_overrides(layers=1)
    chunked = StepPlan(degree=4)
    gap = simulate_step(twin, model, chunked).step_s - simulate_step(plain, model, chunked).step_s
    assert gap == pytest.approx(2 * 3 * twin.device.chunk_s, rel=1e-6)  # 3 more chunks, forward and backward
    assert simulate_step(twin, model, StepPlan()).step_s == simulate_step(plain, model, StepPlan()).step_s


def test_plan_and_train_name_the_fix_for_bad_plan_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=r"ep sizes \[3\] do not tile"):
        main(["plan", "--cluster", "lina-a100", "--ep-size", "3"])
    with pytest.raises(SystemExit, match=r"--model .* or --config .*, not both"):
        main(["plan", "--profile", str(PROFILE), "--model", "fastermoe-gpt", "--config", str(PROFILE)])
    assert main(["train", "--plan", str(tmp_path / "missing.toml")]) == 2
    assert "write one with moeflow plan --out" in capsys.readouterr().err
    plan = tmp_path / "plan.toml"
    assert main(["plan", "--profile", str(PROFILE), "--out", str(plan), "--top", "1"]) == 0
    assert main(["train", "--config", str(plan)]) == 2
    assert "pass it as --plan" in capsys.readouterr().err


def test_a_launched_plan_keeps_its_layout_and_refuses_another_cluster() -> None:
    from moeflow.training.launch import launched_config

    planned = TrainConfig(workers=4, ranks_per_node=2, ep_size=2, plan="plan.toml")
    assert launched_config(planned, 4, 2).ep_size == 2  # the launcher's ranks are the plan's
    with pytest.raises(ValueError, match="is for 4 workers, 2 per node; the launcher started 8, 4 per node"):
        launched_config(planned, 8, 4)
    assert launched_config(TrainConfig(workers=4, ep_size=2), 4, 4).ep_size == 2
    assert launched_config(TrainConfig(workers=4, ep_size=2), 8, 8).ep_size is None  # spread over the new count


def test_a_plan_owns_its_layout_over_a_base_configs_and_records_what_a_run_changed(tmp_path: Path) -> None:
    from moeflow.sim.planner import search
    from moeflow.training.plan_file import run_record, write_plan

    c = cluster(nic_gbit=4000.0)
    model = TINY_MODEL.with_overrides(hidden_dim=8192, layers=1)
    results = search(c, model, top=2, space=SearchSpace(ep_sizes=(8,)))
    base = {"steps": 7, "ep_size": 2, "mp_size": 2, "esp_size": 2, "topology_gate": "auto", "grad_sync": "lina"}
    path = tmp_path / "plan.toml"
    table = write_plan(path, results, c, model, {**settings_of_model(model), **base}, None)
    settings, _ = read_plan_file(str(path))
    assert settings["steps"] == 7 and settings["grad_sync"] != "lina"
    assert not {"ep_size", "mp_size", "esp_size", "topology_gate"} & set(settings)  # the defaults: the plan's layout
    config = TrainConfig(**{**settings, "plan": str(path), "pipeline": 3})
    record = run_record(config)
    assert record["label"] == table["label"]
    assert record["overridden"] == {"pipeline": {"plan": settings["pipeline"], "run": 3}}


def test_planning_inference_does_not_write_a_training_plan_and_odd_text_round_trips(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="drop --forward-only"):
        main(["plan", "--cluster", "lina-a100", "--forward-only", "--out", str(tmp_path / "plan.toml")])
    path = tmp_path / "odd.toml"
    write_plan_file(path, {"run_dir": "runs/\U0001f680 \\ \"x\"\n"}, {"predicted_step_ms": 1.0, "label": "é"}, "")
    settings, table = read_plan_file(str(path))
    assert settings["run_dir"] == "runs/\U0001f680 \\ \"x\"\n" and table["label"] == "é"


def test_the_copies_of_an_expert_group_are_summed_once_after_the_backward() -> None:
    from moeflow.perf.sim.workload import routing_loads
    from moeflow.sim.step import step_builder

    builder = step_builder(cluster(), TINY_MODEL, StepPlan(ep=4, bucket_mb=math.inf))
    timeline = builder.build(routing_loads(TINY_MODEL, 4))
    synced = [i for i, op in enumerate(timeline.ops) if op.category == "allreduce-experts"]
    assert len(synced) == 1 and synced[0] > max(i for i, op in enumerate(timeline.ops) if op.category == "experts")
