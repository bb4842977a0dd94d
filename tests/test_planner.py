"""The planner's policies inside a real layer: search fills Tutel's dictionary, auto times the
model's top candidates and the power-of-two anchors, model follows the PipeMoE prediction, forced
settings are kept, and every rank makes the same choices; the search's budget, pruning and replan
margin as bookkeeping."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.comm import ParallelGroups
from moeflow.comm.topology import Topology
from moeflow.config import LayerDims
from moeflow.parallel.online_planner import MIN_GAIN, simplest_within
from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
from moeflow.perf.schedule_models import ExpertParallelModel, Plan, rank_schedule_plans
from moeflow.perf.shape import RegionShape
from pool import run_distributed

PROFILE = ClusterProfile(
    nodes=2, ranks_per_node=1,
    fits={"gemm": AlphaBeta(2e-5, 1.3e-11), "alltoall.linear": AlphaBeta(3e-4, 8e-9),
          "alltoall.pairwise": AlphaBeta(4e-4, 8e-9)},
)


LAYER_MODEL = ExpertParallelModel(exchange="auto", dedup_candidate=True)
"""The plans a default layer's planner ranks (token_exchange='auto', dedup priced where a profile is)."""


def _steps(layer: MoELayer, steps: int, tokens: int) -> list[dict[str, Any]]:
    plans = []
    for step in range(steps):
        x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        y = layer(x)
        (y.square().sum() + layer.aux_loss).backward()
        stats = layer.last_stats
        assert stats is not None
        assert stats.plan is not None
        plans.append({**asdict(stats.plan), "forward_s": stats.timing.forward_s, "backward_s": stats.timing.backward_s})
    return plans


def _policies(rank: int, world: int) -> dict[str, Any]:
    groups = ParallelGroups(dist.group.WORLD, Topology(world, 1))  # one rank per node
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    # capacity 2 (k=2, 8 experts, 8 tokens): degrees collapse to {1, 2}, two candidates x 3 trials
    search = MoELayer(16, 32, 8, alltoall="linear", pipeline="search", group=groups)
    results["search"] = _steps(search, 8, 8)
    results["search_dictionary"] = {key: (p.degree, p.algorithm) for key, p in search.planner.dictionary.items()}
    results["search_measured"] = {
        key: {(p.degree, p.algorithm): t for p, t in m.items()} for key, m in search.planner.measured.items()
    }
    auto = MoELayer(16, 32, 8, pipeline="auto", profile=PROFILE, group=groups)
    results["auto"] = _steps(auto, 12, 64)
    model = MoELayer(16, 32, 8, pipeline="model", profile=PROFILE, group=groups)
    results["model"] = _steps(model, 2, 64)
    results["forced"] = _steps(MoELayer(16, 32, 8, pipeline=4, alltoall="pairwise", group=groups), 1, 64)
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_policies, 2, timeout_s=240, collective_timeout_s=60)


@pytest.mark.distributed
def test_search_times_each_candidate_then_serves_the_fastest(two_ranks: list[dict[str, Any]]) -> None:
    plans = two_ranks[0]["search"]
    trials = sum(p["source"] == "trial" for p in plans)  # two candidates, rounds of one trial each
    assert 2 <= trials <= 6
    assert [p["source"] for p in plans] == ["warmup"] + ["trial"] * trials + ["settled"] * (7 - trials)
    assert [p["requested_degree"] for p in plans[:3]] == [1, 1, 2]
    measured = two_ranks[0]["search_measured"][0]
    plans_measured = [Plan("expert", degree, algorithm) for degree, algorithm in measured]
    chosen = simplest_within(plans_measured, list(measured.values()), MIN_GAIN)
    best = (chosen.degree, chosen.algorithm)
    assert two_ranks[0]["search_dictionary"] == {0: best}
    assert (plans[-1]["requested_degree"], plans[-1]["alltoall"]) == best
    assert all(p["forward_s"] > 0 and p["backward_s"] > 0 for p in plans)


@pytest.mark.distributed
def test_every_rank_makes_the_same_choices(two_ranks: list[dict[str, Any]]) -> None:
    def choices(result: dict[str, Any]) -> list[tuple]:
        return [(p["source"], p["requested_degree"], p["alltoall"]) for policy in ("search", "auto", "model")
                for p in result[policy]]

    assert choices(two_ranks[0]) == choices(two_ranks[1])
    assert two_ranks[0]["search_dictionary"] == two_ranks[1]["search_dictionary"]
    # the dictionary keeps the slowest rank's median: both ranks hold the same numbers
    assert two_ranks[0]["search_measured"] == two_ranks[1]["search_measured"]


@pytest.mark.distributed
def test_auto_times_the_models_top_three_and_the_power_of_two_anchors(two_ranks: list[dict[str, Any]]) -> None:
    plans = two_ranks[0]["auto"]
    capacity = 16  # 64 tokens, k=2, 8 experts, f=1
    shape = RegionShape(LayerDims(16, 32, 8), 2, capacity)
    expert = LAYER_MODEL  # capacity-chunk plans (token_exchange='auto' and dedup) and FasterMoE's smart schedule
    ranked = rank_schedule_plans(CostModel(PROFILE), shape, [expert], range(1, 17), ("linear", "pairwise"), True)
    top = [plan for plan, _ in ranked[:3]]
    best = next(plan for plan, _ in ranked if plan.schedule == "expert")
    anchors = [p for p in expert.candidates(shape, (1, 2, 4, 8), (top[0].algorithm,), CostModel(PROFILE))
               if p.schedule != "expert" or p.exchange == best.exchange]
    candidates = [(p.schedule, p.degree, p.algorithm, p.exchange) for p in dict.fromkeys(top + anchors)]
    assert 4 <= len(candidates) <= 8
    trials = sum(p["source"] == "trial" for p in plans)  # the first round times each, in the model's order
    assert len(candidates) <= trials <= 8
    assert [p["source"] for p in plans] == ["warmup"] + ["trial"] * trials + ["settled"] * (len(plans) - trials - 1)
    ran = [(p["schedule"], p["requested_degree"], p["alltoall"], p["token_exchange"]) for p in plans]
    ran = [(schedule, degree, algorithm, "padded" if schedule == "smart" else exchange)
           for schedule, degree, algorithm, exchange in ran]  # smart's steps send padded slots
    assert ran[1:len(candidates) + 1] == candidates and ran[-1] in candidates
    assert all(p["predicted_forward_s"] > 0 and p["predicted_backward_s"] > 0 for p in plans)


@pytest.mark.distributed
def test_model_and_forced_plans(two_ranks: list[dict[str, Any]]) -> None:
    shape = RegionShape(LayerDims(16, 32, 8), 2, 16)
    cost = CostModel(PROFILE)
    (best, _), *_ = rank_schedule_plans(cost, shape, [LAYER_MODEL], range(1, 17), ("linear", "pairwise"), True)
    predicted = LAYER_MODEL.predict(best, cost, shape, True)
    for plan in two_ranks[0]["model"]:
        assert (plan["source"], plan["requested_degree"], plan["alltoall"], plan["token_exchange"]) == \
            ("model", best.degree, best.algorithm, best.exchange)
        assert plan["predicted_forward_s"] == pytest.approx(predicted.forward_s)
    (forced,) = two_ranks[0]["forced"]
    assert (forced["source"], forced["pipeline_degree"], forced["alltoall"]) == ("forced", 4, "pairwise")


def test_single_process_runs_one_chunk_unless_forced() -> None:
    x = torch.randn(32, 16)
    layer = MoELayer(16, 32, 4)
    layer(x)
    assert layer.last_stats is not None
    assert layer.last_stats.plan is not None
    assert (layer.last_stats.plan.alltoall, layer.last_stats.plan.pipeline_degree) == ("none", 1)
    forced = MoELayer(16, 32, 4, pipeline=4, expert_kernel="bmm")  # the ragged kernel on one rank runs no chunks
    forced(x)
    assert forced.last_stats is not None and forced.last_stats.plan is not None
    assert forced.last_stats.plan.pipeline_degree == 4
    assert forced.last_stats.timing.forward_s is not None and forced.last_stats.timing.backward_s is None


@pytest.mark.parametrize("bad", [0, -2, 65, 2.5, "fast", True])
def test_bad_pipeline_setting_names_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="pipeline"):
        MoELayer(16, 32, 4, pipeline=bad)  # type: ignore[arg-type]


def _model_without_profile(rank: int, world: int) -> str:
    try:
        MoELayer(16, 32, 4, pipeline="model")
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_model_policy_without_a_profile_says_how_to_get_one() -> None:
    (message,) = run_distributed(_model_without_profile, 1, timeout_s=60)
    assert "profile" in message and "moeflow calibrate" in message


def test_a_pipelined_plan_must_beat_the_simpler_ones_by_the_margin() -> None:
    plans = [Plan("expert", 1, "linear"), Plan("expert", 2, "linear"), Plan("expert", 8, "pairwise")]
    assert simplest_within(plans, [1.00, 0.97, 0.96], 0.05) == plans[0]  # inside the noise: d=1
    assert simplest_within(plans, [1.00, 0.90, 0.89], 0.05) == plans[1]  # d=2 gains; d=8 adds nothing
    assert simplest_within(plans, [1.00, 0.90, 0.80], 0.05) == plans[2]
    assert simplest_within(plans, [1.00, 0.97, 0.96], 0.0) == plans[2]  # no margin: the fastest


def test_a_restored_planner_makes_the_choices_the_interrupted_one_would_have_made() -> None:
    """The checkpoint holds the planner's dictionary and its searches in progress: a planner
    restored from :meth:`state_dict` (through JSON, as the trainer writes it) continues exactly."""
    import json

    from moeflow.parallel.online_planner import OnlinePlanner
    from moeflow.perf.shape import RegionShape

    def planner() -> OnlinePlanner:
        return OnlinePlanner("search", ("linear", "pairwise"), None, reduce_max=list)

    def drive(p: OnlinePlanner, shapes: list[RegionShape]) -> list[tuple[str, int, str]]:
        choices = []
        for shape in shapes:
            choice, timing = p.choose(shape, backward=True)
            timing.forward_s = 1.0 / choice.plan.degree + (0.3 if choice.plan.algorithm == "linear" else 0.0)
            choices.append((choice.source, choice.plan.degree, choice.plan.algorithm))
        return choices

    small, large = (RegionShape(LayerDims(16, 32, 8), 2, capacity) for capacity in (64, 1024))
    shapes = [small] * 12 + [large] * 6 + [small] * 3 + [large] * 12
    whole = planner()
    uninterrupted = drive(whole, shapes)
    interrupted = planner()
    before = drive(interrupted, shapes[:18])  # the small key decided, the large key's search half done
    assert interrupted.dictionary and interrupted._searches
    restored = planner()
    restored.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    after = drive(restored, shapes[18:])
    assert before + after == uninterrupted
    assert drive(planner(), shapes[18:]) != after  # without the state, the searches start over
    assert restored.dictionary == whole.dictionary and restored.dictionary[1024 // 128].degree > 1


def _drive(planner: Any, capacities: list[int], seconds: Any) -> list[tuple[str, int]]:
    """Each call's (source, degree) when a plan of degree d takes ``seconds(d)`` on the slowest rank."""
    from moeflow.perf.shape import RegionShape

    choices = []
    for capacity in capacities:
        choice, timing = planner.choose(RegionShape(LayerDims(16, 32, 8), 2, capacity), backward=True)
        timing.forward_s = seconds(choice.plan.degree)
        choices.append((choice.source, choice.plan.degree))
    return choices


def _search_planner(**budget: Any) -> Any:
    from moeflow.parallel.online_planner import OnlinePlanner, TrialBudget

    return OnlinePlanner("search", ("linear",), None, reduce_max=list, budget=TrialBudget(**budget))


def test_the_search_settles_by_the_tenth_call_and_reports_what_its_trials_cost() -> None:
    """Four close candidates, none pruned: one untimed call, two rounds of four trials, settled at
    the 10th call on the fastest; the cost is the trials' time over the settled plan's."""
    times = {1: 0.010, 2: 0.009, 4: 0.011, 8: 0.0115}
    planner = _search_planner()
    choices = _drive(planner, [512] * 12, times.get)
    assert [source for source, _ in choices] == ["warmup"] + ["trial"] * 8 + ["settled"] * 3
    assert [degree for _, degree in choices[1:9]] == [1, 2, 4, 8, 2, 1, 4, 8]  # round two: fastest first
    assert choices[-1] == ("settled", 2)
    choice, _ = planner.choose(RegionShape(LayerDims(16, 32, 8), 2, 512), backward=True)
    assert choice.trial_cost_s == pytest.approx(2 * (0.001 + 0.002 + 0.0025))


def test_a_candidate_far_behind_the_fastest_stops_after_one_trial() -> None:
    """d = 4 and 8 take over 30 % longer than d = 1: one trial each, then d = 1 and 2 share the
    budget's remaining calls (three trials each at most) and the search settles sooner."""
    times = {1: 0.010, 2: 0.0102, 4: 0.014, 8: 0.030}
    choices = _drive(_search_planner(), [512] * 12, times.get)
    trials = [degree for source, degree in choices if source == "trial"]
    assert trials == [1, 2, 4, 8, 1, 2, 1, 2]
    assert choices[9] == ("settled", 1)  # d = 2 gains under 5 %: the simpler plan


def test_the_time_budget_ends_a_search_after_its_round() -> None:
    times = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3}
    choices = _drive(_search_planner(seconds=2.0), [512] * 7, times.get)
    assert [source for source, _ in choices] == ["warmup"] + ["trial"] * 4 + ["settled"] * 2


def test_the_plan_is_kept_while_the_capacity_stays_within_the_margin() -> None:
    """A dropless layer's capacity moves a little from step to step: within 25 % of the capacity a
    plan settled at (or a search in progress started at), the plan or the search carries on; a
    capacity further away is searched anew."""
    times = {1: 0.010, 2: 0.009, 4: 0.011, 8: 0.012}
    planner = _search_planner()
    wobbling = [512, 600, 560, 470, 630, 512, 590, 520, 600, 610, 400]  # buckets of 128: keys 3 to 4
    choices = _drive(planner, wobbling, times.get)
    assert [source for source, _ in choices] == ["warmup"] + ["trial"] * 8 + ["settled"] * 2
    assert list(planner.dictionary) == [4]
    far = _drive(planner, [1024], times.get)
    assert far == [("warmup", 1)] and set(planner._searches) == {8}
    assert planner.settled_at == {4: 512}


def test_a_call_outside_training_mode_spends_no_trial() -> None:
    """An evaluation forward during a search runs the first candidate untimed (its time has no
    backward in it): the search's trials and its settled plan are those of the training calls."""
    from moeflow.parallel.online_planner import UNTIMED
    from moeflow.perf.shape import RegionShape

    times = {1: 0.010, 2: 0.009, 4: 0.011, 8: 0.0115}
    planner, shape = _search_planner(), RegionShape(LayerDims(16, 32, 8), 2, 512)
    training = _drive(planner, [512] * 3, times.get)
    evaluation, _ = planner.choose(shape, backward=False, timed=False)
    assert (evaluation.source, evaluation.plan.degree) == (UNTIMED, 1)
    rest = _drive(planner, [512] * 9, times.get)
    assert [source for source, _ in training + rest] == ["warmup"] + ["trial"] * 8 + ["settled"] * 3
    settled, _ = planner.choose(shape, backward=False, timed=False)
    assert settled.source == "settled"


def test_a_budget_without_calls_names_its_fields() -> None:
    from moeflow.parallel.online_planner import TrialBudget

    with pytest.raises(ValueError, match="calls >= 1"):
        TrialBudget(calls=0)
