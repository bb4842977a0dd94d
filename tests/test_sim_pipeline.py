"""The simulator and the joint planner price pipeline parallelism: a pipelined step is the stage
schedule (``moeflow.perf.stage_schedule``) run on one stage's simulated micro-batch, plus the
gradient sync and optimizer once; the planner searches the pipeline size, schedule and micro-batch
count, ``moeflow plan --out`` writes a pipelined plan and ``moeflow train --plan`` runs it."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from moeflow.cli import main
from moeflow.config import LayerDims
from moeflow.perf.sim.cluster import Cluster, Device, Link
from moeflow.perf.sim.plan import schedule_pairs, schedule_stages
from moeflow.perf.sim.workload import ModelSpec
from moeflow.perf.stage_schedule import simulate_stages, stage_orders
from moeflow.sim import StepPlan, plan_label, simulate_step
from moeflow.sim.pipelined import pipeline_layout, pipeline_sizes, stage_plan
from moeflow.sim.planner import PIPELINE_SCHEDULES, SearchSpace, candidate_plans, search
from moeflow.training import TrainConfig
from moeflow.training.plan_file import read_plan_file, write_plan

PROFILE = Path(__file__).parent / "data" / "sim_validation" / "profile-2x1-1gbit.json"
MODEL = ModelSpec("small", 4, LayerDims(256, 512, 8, 2, bias=False), 1.0, 4096, 256, "fp32", vocab_size=4096)


def cpu_like(nodes: int = 2, per_node: int = 2, gbit: float = 1.0) -> Cluster:
    """A small cluster whose links are slow beside its compute, as the emulated CPU cluster's."""
    return Cluster("cpu-like", nodes, per_node, Device("cpu", 5e10, 5e-6, 1e10), Link(10e9 / 8, 20e-6, 5e-6),
                   Link(gbit * 1e9 / 8, 50e-6, 10e-6))


def pipelined(schedule: str = "1f1b", microbatches: int | None = None, pp: int = 2, **knobs: object) -> StepPlan:
    return StepPlan(pp=pp, pp_schedule=schedule, microbatches=microbatches, bucket_mb=math.inf, **knobs)


def test_an_unpipelined_plan_prices_and_reads_as_before() -> None:
    plan = StepPlan()
    assert (plan.pp, plan.pipeline_microbatches, plan.pipeline_label()) == (1, 1, "")
    result = simulate_step(cpu_like(), MODEL, plan)
    assert plan_label(result.plan) == "expert d=1 linear" and "pipeline" not in result.extra
    assert result.step_s == simulate_step(cpu_like(), MODEL, StepPlan(pp=1, pp_schedule="dualpipev")).step_s


def test_the_stage_counts_are_the_runtimes() -> None:
    """The simulator reads a schedule's stages off the priced orders; the trainer's layout agrees."""
    from moeflow.pipeline.layout import SCHEDULES

    for name, layout in SCHEDULES.items():
        assert schedule_pairs(name) == layout.pairs_forward_backward, name
        for pp in (1, 2, 3, 4):
            assert schedule_stages(name, pp) == layout.num_stages(pp), (name, pp)


def test_a_pipelined_step_is_the_stage_schedule_run_on_one_stages_micro_batch() -> None:
    cluster, plan = cpu_like(), pipelined("1f1b", 4)
    result = simulate_step(cluster, MODEL, plan)
    layout = pipeline_layout(cluster, MODEL, plan)
    assert layout.stage_cluster.world_size == 2 and layout.stage_model.layers == 2
    assert layout.stage_model.tokens_per_rank == 2048  # the global batch on 2 data ranks, in 4 micro-batches
    costs = result.extra["pipeline"]
    forward, backward, weight, send = (costs[k] / 1e3 for k in ("forward_ms", "backward_ms", "weight_ms", "send_ms"))
    tail = costs["tail_ms"] / 1e3
    times = simulate_stages(stage_orders("1f1b", 2, 4), forward, backward, send, weight)
    assert result.step_s == pytest.approx(times.step_s + tail)
    # the stage's unpipelined micro-batch is F + B + the tail (grad_sync 'after': once, at the end)
    alone = simulate_step(layout.stage_cluster, layout.stage_model, stage_plan(plan))
    assert alone.step_s == pytest.approx(forward + backward + tail)
    assert 0 < weight < backward and send > 0 and tail > 0
    assert plan_label(plan).endswith(" pp=2 1f1b m=4")


def test_more_micro_batches_approach_the_steady_state() -> None:
    """1F1B's bubble, (P - 1) / (M + P - 1) without sends, shrinks with M: the step nears M (F + B)
    of its micro-batches (on one node, where a send is short beside a stage's work)."""
    overheads = []
    for microbatches in (2, 4, 8, 16):
        result = simulate_step(cpu_like(1, 4), MODEL, pipelined("1f1b", microbatches))
        costs = result.extra["pipeline"]
        steady = microbatches * (costs["forward_ms"] + costs["backward_ms"])
        overheads.append((result.step_s * 1e3 - costs["tail_ms"]) / steady)
        assert costs["bubble"] == pytest.approx(1 / (microbatches + 1), abs=0.02)
    assert overheads == sorted(overheads, reverse=True) and 1.0 < overheads[-1] < 1.1


def test_dualpipes_overlap_hides_the_all_to_alls_where_a_stage_has_them() -> None:
    cluster = cpu_like(1, 4)  # pp 2: a stage of 2 ranks with an expert group of 2; pp 4: one rank, no all-to-all
    apart = simulate_step(cluster, MODEL, pipelined("dualpipev", 8))
    paired = simulate_step(cluster, MODEL, pipelined("dualpipev", 8, pp_overlap=True))
    costs = paired.extra["pipeline"]
    assert costs["paired_ms"] < costs["forward_ms"] + costs["backward_ms"]
    assert costs["paired_ms"] >= max(costs["forward_ms"], costs["backward_ms"])
    assert paired.step_s < apart.step_s
    deeper = MODEL.with_overrides(layers=8)
    alone = simulate_step(cluster, deeper, pipelined("dualpipev", 8, pp=4, pp_overlap=True)).extra["pipeline"]
    assert alone["paired_ms"] == pytest.approx(alone["forward_ms"] + alone["backward_ms"])  # nothing to hide
    assert plan_label(paired.plan).endswith(" pp=2 dualpipev m=8 overlap")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"])
def test_every_schedule_is_priced(schedule: str) -> None:
    result = simulate_step(cpu_like(), MODEL, pipelined(schedule, 8))
    assert result.step_s > 0 and result.extra["pipeline"]["stages"] == schedule_stages(schedule, 2)


def test_bad_pipeline_knobs_name_the_field_and_the_fix() -> None:
    for knobs, match in (({"shadowed": 1}, "change shadowed"), ({"bucket_mb": 0.0}, "change bucket_mb"),
                         ({"pp_schedule": "nope"}, "pp_schedule: .* not priced"),
                         ({"pp_overlap": True}, "set pp_schedule='dualpipev' or pp_overlap=False"),
                         ({"microbatches": 1}, "microbatches must be None or an integer >= the 2 stages"),
                         ({"pp_schedule": "interleaved", "microbatches": 5}, "microbatches=5 .* multiple of")):
        with pytest.raises(ValueError, match=match):
            StepPlan(**{"pp": 2, "bucket_mb": math.inf, **knobs})
    with pytest.raises(ValueError, match="set pp > 1"):
        StepPlan(microbatches=4)
    with pytest.raises(ValueError, match=r"pp=3 must split the 4 ranks .* use one of \[1, 2, 4\]"):
        simulate_step(cpu_like(), MODEL, pipelined(pp=3, microbatches=4))
    with pytest.raises(ValueError, match="makes 8 stages and the model has 4 layers"):
        simulate_step(cpu_like(), MODEL, pipelined("interleaved", pp=4, microbatches=8))
    with pytest.raises(ValueError, match="must divide a data rank's 8192 tokens"):
        simulate_step(cpu_like(), MODEL, pipelined("1f1b", 3))
    with pytest.raises(ValueError, match="prices a pipelined training step"):
        simulate_step(cpu_like(), MODEL, pipelined(), training=False)


def test_the_planner_searches_pipelines_by_default_and_prices_them_as_simulate_step() -> None:
    cluster = cpu_like()
    plans = candidate_plans(cluster, MODEL)
    piped = [plan for plan in plans if plan.pp > 1]
    assert {plan.pp for plan in piped} == {2, 4} and pipeline_sizes(cluster) == [1, 2, 4]
    assert {plan.pp_schedule for plan in piped} == set(PIPELINE_SCHEDULES)  # not gpipe, not zbv
    sequences = MODEL.tokens_per_rank // MODEL.sequence_length
    assert all(sequences * plan.pp % plan.pipeline_microbatches == 0
               and plan.pipeline_microbatches >= plan.pipeline_stages
               and not plan.shadowed and plan.bucket_mb == math.inf for plan in piped)
    assert all(plan.pp_overlap == ((plan.ep or 4 // plan.pp) > 1) for plan in piped if plan.pp_schedule == "dualpipev")
    best = search(cluster, MODEL, top=3)  # every layout on the same global batch: the fastest of both searches
    piped_best = search(cluster, MODEL, top=1, space=SearchSpace(pp_sizes=(2, 4)))[0]
    unpipelined = search(cluster, MODEL, top=1, space=SearchSpace(pp_sizes=(1,)))[0]
    assert piped_best.plan.pp > 1 and unpipelined.plan.pp == 1
    assert best[0].step_s == pytest.approx(min(piped_best.step_s, unpipelined.step_s))
    for result in (best[0], piped_best):
        assert result.step_s == pytest.approx(simulate_step(cluster, MODEL, result.plan).step_s)


def test_a_restricted_search_returns_pipelined_plans_that_train_accepts(tmp_path: Path) -> None:
    from moeflow.training.plan_file import settings_of_model

    cluster = cpu_like()
    results = search(cluster, MODEL, top=4, space=SearchSpace(pp_sizes=(2,)))
    assert all(result.plan.pp == 2 for result in results)
    path = tmp_path / "plan.toml"
    table = write_plan(path, results, cluster, MODEL, {**settings_of_model(MODEL), "profile": "x.json"}, "x.json")
    settings, written = read_plan_file(str(path))
    plan = results[0].plan
    assert settings["pp_size"] == 2 and settings["pp_schedule"] == plan.pp_schedule
    assert settings["microbatches"] == plan.pipeline_microbatches and settings["pp_overlap"] == plan.pp_overlap
    assert "profile" not in settings and settings["grad_sync"] == "after"  # the pipelined trainer takes neither
    assert written["label"] == table["label"] == plan_label(plan)
    config = TrainConfig(**settings)
    assert (config.pp_size, config.stage_workers) == (2, 2)
    unpipelined = settings_of_model(MODEL)["batch_size"]  # the same global batch on half the data ranks
    assert config.batch_size == 2 * unpipelined and config.batch_size * 2 == unpipelined * cluster.world_size


def test_the_search_refuses_pipelines_that_cannot_be() -> None:
    cluster = cpu_like()
    with pytest.raises(ValueError, match=r"pp sizes \[3\] do not split"):
        search(cluster, MODEL, space=SearchSpace(pp_sizes=(3,)))
    with pytest.raises(ValueError, match="more stages than the model's 2 layers"):
        search(cluster, MODEL.with_overrides(layers=2), space=SearchSpace(pp_sizes=(4,)))
    with pytest.raises(ValueError, match=r"no stage plan fits.* 0 sequences of a data rank"):  # no whole sequences
        search(cluster, MODEL.with_overrides(sequence_length=3000), space=SearchSpace(pp_sizes=(2,)))
    with pytest.raises(ValueError, match="drop --forward-only or --pp-size"):
        search(cluster, MODEL, training=False, space=SearchSpace(pp_sizes=(2,)))
    assert all(result.plan.pp == 1 for result in search(cluster, MODEL, training=False, top=2))
    assert {plan.pp for plan in candidate_plans(cluster, MODEL, SearchSpace(prioritize_alltoall=True))} == {1}


def test_simulate_prices_a_pipelined_step_and_names_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--cluster", "lina-a100", "--layers", "4", "--nodes", "2"]
    for schedule in ("gpipe", "zbv"):
        assert main([*base, "--pp-size", "2", "--pp-schedule", schedule, "--microbatches", "4"]) == 0
        record = json.loads(capsys.readouterr().out.splitlines()[0])
        assert record["pipeline"]["microbatches"] == 4 and f"pp=2 {schedule} m=4" in record["plan"]
    assert main([*base, "--pp-size", "2", "--pp-schedule", "dualpipev", "--pp-overlap"]) == 0
    assert "paired_ms" in json.loads(capsys.readouterr().out.splitlines()[0])["pipeline"]
    for flags, match in ((["--microbatches", "4"], "add --pp-size N"),
                         (["--pp-size", "2", "--pp-overlap"], "add --pp-schedule dualpipev"),
                         (["--pp-size", "3"], r"--pp-size 3 must split the 2 x 4 ranks"),
                         (["--pp-size", "2", "--pp-schedule", "interleaved", "--layers", "2"], "use more --layers"),
                         (["--pp-size", "2", "--microbatches", "3"], "--microbatches 3 must be at least"),
                         (["--pp-size", "2", "--inference"], "drop --inference or --pp-size")):
        with pytest.raises(SystemExit, match=match):
            main([*base, *flags])
    with pytest.raises(SystemExit):
        main([*base, "--pp-size", "2", "--pp-schedule", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_plan_names_a_pipeline_it_cannot_search(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"pp sizes \[3\] do not split"):
        main(["plan", "--cluster", "lina-a100", "--pp-size", "3"])
    config = tmp_path / "bf16.toml"
    config.write_text('layers = 4\ndtype = "bf16"\n')
    with pytest.raises(SystemExit, match="does not run dtype='bf16'"):
        main(["plan", "--profile", str(PROFILE), "--config", str(config), "--pp-size", "2", "--out",
              str(tmp_path / "plan.toml")])


@pytest.mark.distributed
def test_moeflow_plan_writes_a_pipelined_plan_that_train_runs(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from test_training import TINY

    config = tmp_path / "tiny.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {**TINY, "layers": 4, "steps": 2}.items()))
    plan = tmp_path / "plan.toml"
    assert main(["plan", "--cluster", str(PROFILE), "--config", str(config), "--pp-size", "2", "--out", str(plan),
                 "--top", "2"]) == 0
    settings, table = read_plan_file(str(plan))
    assert settings["pp_size"] == 2 and settings["workers"] == 2 and "profile" not in settings
    assert f"pp=2 {settings['pp_schedule']} m={settings['microbatches']}" in table["label"]
    capsys.readouterr()
    run_dir = tmp_path / "run"
    assert main(["train", "--plan", str(plan), "--steps", "2", "--run-dir", str(run_dir)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (printed["pp_size"], printed["microbatches"], printed["steps"]) == (2, settings["microbatches"], 2)
    assert printed["plan"]["label"] == table["label"] and printed["plan"]["measured_step_ms"] > 0
    ran = json.loads((run_dir / "config.json").read_text())
    assert (ran["pp_size"], ran["pp_schedule"]) == (2, settings["pp_schedule"])


def test_a_stage_of_one_rank_sends_over_the_node_boundary() -> None:
    """pp 4 on 2 x 2: stages 1 and 2 sit on different nodes, so every send is priced over the NIC."""
    cluster = cpu_like()
    nic = simulate_step(cluster, MODEL, pipelined(pp=4, microbatches=8)).extra["pipeline"]["send_ms"]
    one_node = replace(cluster, nodes=1, gpus_per_node=4)
    intra = simulate_step(one_node, MODEL, pipelined(pp=4, microbatches=8)).extra["pipeline"]["send_ms"]
    assert nic > 5 * intra > 0
