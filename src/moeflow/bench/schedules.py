"""``moeflow bench schedules``: replicated experts against expert parallelism, as whole training
steps on an emulated cluster, and what ``parallel="auto"`` picks.

The driver launches one emulated cluster (2 nodes x 1 rank by default: one rank per core) and
runs this module as every rank; unless a profile is given the ranks calibrate the cluster first.
For each (experts E, hidden H) of the grid at a fixed number of tokens per rank, it builds the
same one-block MoE transformer three times: ``parallel="expert"``, ``"replicated"`` and
``"auto"`` (planned on the profile for this batch). A training step is forward, backward, the
trainer's gradient synchronization (the all-reduce that replicated experts add to) and an AdamW
step. The two fixed schedules and ``auto``'s model are timed round-robin (the slowest rank,
medians): the record says which schedule ``auto`` picked (one of the two, or Tutel's ``adaptive``,
which it also ranks), whether that was the faster of the two, and its step's loss against it.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from moeflow.progress import Progress

SCHEDULES = ("expert", "replicated")


@dataclass(frozen=True)
class SchedulePoint:
    num_experts: int
    hidden_dim: int
    model_dim: int = 256
    batch: int = 8
    context: int = 128

    @property
    def name(self) -> str:
        return f"E{self.num_experts}-H{self.hidden_dim}-M{self.model_dim}-T{self.batch * self.context}"


def _model(point: SchedulePoint, parallel: str, groups: Any, profile: Any) -> Any:
    import torch

    from moeflow.models import MoETransformer, TransformerConfig

    config = TransformerConfig.build(
        vocab_size=512, context=point.context, layers=1, heads=4, model_dim=point.model_dim,
        hidden_dim=point.hidden_dim, num_experts=point.num_experts, capacity_factor=1.0, parallel=parallel,
        tokens_per_rank_hint=point.batch * point.context,
    )
    torch.manual_seed(0)
    return MoETransformer(config, group=groups, seed=0, profile=profile)


def _step_function(model: Any, point: SchedulePoint, rank: int) -> Any:
    """One training step of ``model`` on this rank's batch (what the trainer does, minus data)."""
    import torch
    import torch.distributed as dist

    from moeflow.training.gradients import synchronize_gradients

    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 512, (point.batch, point.context + 1), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    expert_names = model.expert_parameter_names()

    def step() -> None:
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        synchronize_gradients(model, expert_names, dist.group.WORLD, dist.get_world_size())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _measure_point(point: SchedulePoint, groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    import torch.distributed as dist

    from moeflow.bench import record_fields
    from moeflow.bench.timing import SpeedProbe
    from moeflow.timing.measure import slowest_rank_seconds

    rank = dist.get_rank()
    auto = _model(point, "auto", groups, profile)
    models = {name: _model(point, name, groups, profile) for name in SCHEDULES}
    # auto's own model is timed too: it may pick a schedule neither of the two is (adaptive)
    steps = {name: _step_function(model, point, rank) for name, model in {**models, "auto": auto}.items()}
    for _ in range(12):  # warm up, and let the expert schedule's planner finish its online trials
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    probe = SpeedProbe()
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(slowest_rank_seconds(step))
        probe.sample()
    if rank != 0:
        return
    emit(probe.record("schedules", point.name))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    faster = min(SCHEDULES, key=medians.get)
    layer = auto.moe_layers()[0]
    ran = models["expert"].moe_layers()[0].last_stats.plan  # the expert step's planned degree and all-to-all
    emit({
        "bench": "schedules", "config": point.name, **record_fields(point),
        "expert_degree": ran.pipeline_degree, "expert_alltoall": ran.alltoall,
        **{f"{name}_step_ms": seconds * 1e3 for name, seconds in medians.items()},
        "replicated_over_expert": medians["replicated"] / medians["expert"], "faster": faster,
        "auto_picked": layer.schedule.name, "auto_reason": layer.schedule_reason,
        "auto_picked_faster": layer.schedule.name == faster,
        "auto_loss_vs_faster": medians["auto"] / medians[faster] - 1.0,
    })


def _rank_main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    grid_rank_main(argv, "schedules", lambda values, *rest: _measure_point(SchedulePoint(**values), *rest))


def run(
    grid: list[SchedulePoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29760, timeout_s: float = 3600, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid, return rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.schedules", "schedules", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile,
                          master_port, timeout_s, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The crossover (which schedule wins at each (E, H)) and how often auto ran the faster one."""
    points = [r for r in records if r.get("bench") == "schedules"]
    if not points:
        return {"summary": "schedules", "configs": 0}
    table = {f"E{r['experts']}-H{r['hidden_dim']}": round(r["replicated_over_expert"], 3) for r in points}
    return {
        "summary": "schedules", "configs": len(points),
        "replicated_over_expert_step_time": table,
        "replicated_faster": [r["config"] for r in points if r["faster"] == "replicated"],
        "auto_picked_faster_share": sum(r["auto_picked_faster"] for r in points) / len(points),
        "auto_worst_loss_vs_faster": max(r["auto_loss_vs_faster"] for r in points),
    }


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
