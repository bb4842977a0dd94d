"""A technique is one module and one record: the toy schedule below, defined in this file and
installed with one record under the ``moeflow.techniques`` entry point group, is built by the
layer, priced and chosen by ``parallel='auto'``, simulated, and searched by ``moeflow plan
--cluster``, with no moeflow file touched. The toy is the replicated schedule under another name,
priced at half its cost and simulated with free experts, so that each consumer visibly picks it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from moeflow.parallel.records import ENTRY_POINT_GROUP, ScheduleSpec, ShardingLayout
from moeflow.perf.pipeline import PlanPrediction
from moeflow.perf.schedule_models import Plan, ReplicatedModel
from moeflow.perf.sim.builder import StepBuilder
from moeflow.perf.sim.plan import StepPlan
from moeflow.perf.sim.technique import PlanSpace, SimulatedSchedule
from moeflow.perf.sim.workload import LayerLoad

TOY_NAME = "toy"


@dataclass(frozen=True)
class ToyModel(ReplicatedModel):
    """The replicated schedule's cost, halved."""

    name: str = TOY_NAME

    def predict(self, plan: Plan, cost: object, shape: object, backward: bool) -> PlanPrediction:
        full = super().predict(plan, cost, shape, backward)  # type: ignore[arg-type]
        return PlanPrediction(full.degree, full.algorithm, full.forward_s / 2, full.backward_s / 2,
                              full.gradient_sync_s / 2, full.expert_memory_bytes, self.name)


def make_toy(layout: ShardingLayout) -> object:
    from moeflow.parallel.schedules import ReplicatedSchedule

    @dataclass(frozen=True)
    class ToySchedule(ReplicatedSchedule):
        name: str = TOY_NAME

        @property
        def model(self) -> ToyModel:
            return ToyModel()

    return ToySchedule()


def free_experts(builder: StepBuilder, load: LayerLoad, deps: list[int], backward: bool) -> list[int]:
    return deps  # the experts cost nothing: the toy is the fastest plan anywhere


def toy_plans(name: str, space: PlanSpace) -> list[StepPlan]:
    return [StepPlan(name, prioritize_alltoall=space.prioritize_alltoall)]


TOY = ScheduleSpec(TOY_NAME, "a test's toy", make_toy, SimulatedSchedule(free_experts, toy_plans), takes_ragged=True,
                   ranked_by_auto=True, replicates_experts=True)
"""The one record: what the entry point names."""

CHECKS = textwrap.dedent("""
    import json
    import torch
    from moeflow import MoELayer
    from moeflow.config import LayerDims
    from moeflow.parallel.registry import PARALLEL_CHOICES, select_schedule
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
    from moeflow.perf.shape import RegionShape
    from moeflow.sim import StepPlan, load_cluster, load_model, plan_label, simulate_step

    torch.manual_seed(0)
    toy = MoELayer(model_dim=8, hidden_dim=16, num_experts=4, top_k=2, parallel="toy")
    replicated = MoELayer(model_dim=8, hidden_dim=16, num_experts=4, top_k=2, parallel="replicated")
    replicated.load_state_dict(toy.state_dict())
    tokens = torch.randn(2, 5, 8, requires_grad=True)
    outputs = [layer(tokens) for layer in (toy, replicated)]
    grads = [torch.autograd.grad(out.sum(), tokens)[0] for out in outputs]
    cost = CostModel(ClusterProfile(nodes=2, ranks_per_node=1, fits={
        "gemm": AlphaBeta(1e-5, 1e-11), "alltoall.linear": AlphaBeta(1e-4, 8e-9), "allreduce": AlphaBeta(1e-4, 8e-9)}))
    shape = RegionShape(LayerDims(model_dim=256, hidden_dim=64, num_experts=2), world_size=2, capacity=1024)
    chosen = select_schedule("auto", 2, 2, cost, shape, ("linear",))
    cluster, model = load_cluster("tutel-a100"), load_model(None).with_overrides(layers=2)
    simulated = simulate_step(cluster, model, StepPlan("toy"))
    print(json.dumps({
        "choices": list(PARALLEL_CHOICES), "built": toy.schedule.name,
        "same_output": torch.equal(outputs[0], outputs[1]), "same_grad": torch.equal(grads[0], grads[1]),
        "auto": [chosen.schedule.name, chosen.reason], "label": plan_label(StepPlan("toy")),
        "simulated_ms": simulated.step_s * 1e3,
    }))
""")


def _install(tmp_path: Path) -> dict[str, str]:
    """A distribution's metadata naming :data:`TOY` under the entry point group, on the path of a
    fresh interpreter (as ``pip install`` of a package declaring it would leave it)."""
    info = tmp_path / "moeflow_toy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moeflow-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = {Path(__file__).stem}:TOY\n")
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _run(arguments: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, *arguments], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_a_toy_technique_with_one_record_is_built_priced_simulated_and_searched(tmp_path: Path) -> None:
    env = _install(tmp_path)
    checks = json.loads(_run(["-c", CHECKS], env).splitlines()[-1])
    assert TOY_NAME in checks["choices"] and checks["built"] == TOY_NAME
    assert checks["same_output"] and checks["same_grad"]  # the replicated schedule under another name
    assert checks["auto"] == [TOY_NAME, "model"]  # priced at half the replicated cost: auto chooses it
    assert checks["label"] == TOY_NAME and checks["simulated_ms"] > 0
    searched = _run(["-m", "moeflow", "plan", "--cluster", "tutel-a100", "--ep-size", "2048", "--top", "2"], env)
    ranked = [json.loads(line)["plan"].split()[0] for line in searched.splitlines() if line.startswith("{")]
    assert ranked[0] == TOY_NAME  # free experts: the fastest plan the search found over the world's ranks


def test_without_the_entry_point_the_toy_is_unknown() -> None:
    from moeflow.parallel.registry import PARALLEL_CHOICES, SIMULATED

    assert TOY_NAME not in PARALLEL_CHOICES and TOY_NAME not in SIMULATED


def test_an_entry_point_that_names_no_record_or_a_taken_name_is_refused(tmp_path: Path) -> None:
    """A clear error names the entry point and the fix, at the registry's import."""
    env = _install(tmp_path)
    (tmp_path / "moeflow_toy-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nbad = {Path(__file__).stem}:TOY_NAME\n")
    done = subprocess.run([sys.executable, "-c", "import moeflow.parallel.registry"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "entry point 'bad'" in done.stderr and "point it at the record" in done.stderr
    (tmp_path / "moeflow_toy-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ntwice = {Path(__file__).stem}:TAKEN\n")
    done = subprocess.run([sys.executable, "-c", "import moeflow.parallel.registry"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "two techniques are named 'expert'" in done.stderr


TAKEN = ScheduleSpec("expert", "a record that takes a built-in name", make_toy,
                     SimulatedSchedule(free_experts, toy_plans))
