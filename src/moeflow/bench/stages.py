"""``moeflow bench stages``: the pipeline schedules side by side on the emulated cluster, DualPipeV
with and without its overlap.

The driver launches one emulated cluster (2 nodes x 2 ranks by default) and runs this module as
every rank. The mesh is ``(pp, ep)`` with each stage's expert group across the nodes (rank
``node * ranks_per_node + i`` holds stage ``i``'s experts on that node: the stages' point-to-point
sends stay inside a node, the all-to-alls cross the slow link, DualPipe's setting). Every setting
is built up front, each with the same model and batch: one pipeline per schedule, and DualPipeV
twice (``overlap`` on and off). A step is the forward and backward of every micro-batch
(:meth:`~moeflow.pipeline.build.Pipeline.step`); the settings are timed round-robin after a warm-up
round, the slowest rank's time kept, median over the repeats. Each action of each stage is timed
as the runtime calls it (:mod:`moeflow.bench.stage_clock`), and the schedule's step is priced on
those stage costs by :mod:`moeflow.perf.stage_schedule`. Rank 0 prints one JSON object per setting
(measured, predicted, each stage's medians); the summary gives each schedule's step time, the
overlap's speed-up and the largest prediction error.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from moeflow.progress import Progress

SETTINGS = (("gpipe", False), ("1f1b", False), ("interleaved", False), ("zbv", False), ("dualpipev", False),
            ("dualpipev", True))
"""(schedule, overlap) of each setting measured."""


@dataclass(frozen=True)
class StagePoint:
    """One model and batch: blocks, widths, experts, and a step's sequences in micro-batches (the
    command line's values: ``moeflow bench stages``)."""

    layers: int
    model_dim: int
    hidden_dim: int
    experts: int
    top_k: int
    heads: int
    context: int
    batch: int
    microbatches: int

    @property
    def name(self) -> str:
        return (f"L{self.layers}-M{self.model_dim}-H{self.hidden_dim}-E{self.experts}-k{self.top_k}"
                f"-B{self.batch}x{self.context}-mb{self.microbatches}")


def setting_name(schedule: str, overlap: bool) -> str:
    return f"{schedule}+overlap" if overlap else schedule


def _mesh(ranks_per_node: int, nodes: int) -> Any:
    """``(pp, ep)``: stage ``i`` on local rank ``i`` of every node, its expert group across the nodes."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(nodes * ranks_per_node).reshape(nodes, ranks_per_node).T  # [stage][node]
    return DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "ep"))


def _measure_point(values: dict[str, Any], groups: Any, profile: Any, repeats: int, emit: Any) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.stage_clock import COLUMNS, ActionClock, predicted_step_s
    from moeflow.comm.collectives import barrier, reduce_values
    from moeflow.models.transformer import TransformerConfig
    from moeflow.pipeline import pipeline_stages

    point = StagePoint(**values)
    nodes = groups.topology.world_size // groups.topology.ranks_per_node
    mesh = _mesh(groups.topology.ranks_per_node, nodes)
    config = TransformerConfig.build(
        vocab_size=256, context=point.context, layers=point.layers, heads=point.heads, model_dim=point.model_dim,
        hidden_dim=point.hidden_dim, num_experts=point.experts, top_k=point.top_k, capacity_factor=1.25,
        pipeline=1, alltoall="linear", expert_kernel="bmm")
    pipelines = {setting_name(schedule, overlap): pipeline_stages(
        config, mesh, schedule=schedule, microbatches=point.microbatches, batch_size=point.batch, overlap=overlap)
        for schedule, overlap in SETTINGS}
    tokens = torch.randint(0, 256, (point.batch, point.context + 1),
                           generator=torch.Generator().manual_seed(mesh.get_local_rank("ep")))
    samples: dict[str, list[float]] = {name: [] for name in pipelines}
    clocks = {name: ActionClock() for name in pipelines}
    for name, pipeline in pipelines.items():
        clocks[name].attach(pipeline.torch_stages)
    for round_index in range(repeats + 1):  # round 0 warms every setting up
        for name, pipeline in pipelines.items():
            clocks[name].recording = round_index > 0
            barrier()
            start = time.perf_counter()
            pipeline.step(tokens[:, :-1], tokens[:, 1:])
            seconds = time.perf_counter() - start
            for parameter in pipeline.parameters():
                parameter.grad = None
            if round_index:
                samples[name].append(reduce_values([seconds], dist.group.WORLD, op="max")[0])
    tables = {name: reduce_values(clocks[name].table(pipeline.schedule.num_stages(mesh.size(0))), dist.group.WORLD,
                                  op="max") for name, pipeline in pipelines.items()}
    if dist.get_rank() != 0:
        return
    for (schedule, overlap), (name, values_s) in zip(SETTINGS, samples.items(), strict=True):
        step_ms = statistics.median(values_s) * 1e3
        predicted_ms = predicted_step_s(schedule, mesh.size(0), point.microbatches, tables[name]) * 1e3
        emit({"bench": "stages", "config": point.name, **asdict(point), "setting": name, "schedule": schedule,
              "overlap": overlap, "pp_size": mesh.size(0), "ep_size": mesh.size(1), "step_ms": step_ms,
              "predicted_ms": predicted_ms, "error": predicted_ms / step_ms - 1, "repeats": len(values_s),
              "stage_ms": {column: [round(tables[name][stage * len(COLUMNS) + i] * 1e3, 3)
                                    for stage in range(len(tables[name]) // len(COLUMNS))]
                           for i, column in enumerate(COLUMNS)}})


def run(
    grid: list[StagePoint], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None = None, master_port: int = 29760, timeout_s: float = 1800, progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch the emulated cluster, run the grid, return rank 0's records (printed as they come)."""
    from moeflow.bench import run_on_cluster

    return run_on_cluster("moeflow.bench.stages", "stages", grid, nodes, ranks_per_node, inter_gbit, repeats,
                          profile, master_port, timeout_s, calibrate=profile is not None, progress=progress)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: each setting's step time and the overlap's speed-up over DualPipeV run
    one action at a time (1 - overlapped / sequential)."""
    steps: dict[str, dict[str, float]] = {}
    for record in records:
        if record.get("bench") == "stages":
            steps.setdefault(record["config"], {})[record["setting"]] = record["step_ms"]
    gains = {config: 1 - times["dualpipev+overlap"] / times["dualpipev"] for config, times in steps.items()}
    errors = [abs(record["error"]) for record in records if record.get("bench") == "stages"]
    return {"summary": "stages", "step_ms": steps, "overlap_gain": gains,
            "min_overlap_gain": min(gains.values()) if gains else None,
            "max_prediction_error": max(errors) if errors else None}


def main(argv: list[str]) -> None:
    from moeflow.bench import grid_rank_main

    grid_rank_main(argv, "stages", _measure_point)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
