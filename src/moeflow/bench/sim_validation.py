"""``moeflow bench simulator``: the simulator against measurement on the emulated cluster.

Per (layout, bandwidth): the ranks calibrate three times (the median of each fit is the profile,
kept with the three), then three benchmarks measure on that cluster and the profile's simulated
twin predicts the same runs:

- ``bench pipeline``: the MoE layer's forward+backward at every fixed (degree, all-to-all);
- ``bench schedules``: whole training steps of a one-block MoE transformer, expert parallelism
  (its degree and all-to-all planned: the twin's best of them) against replicated experts;
- ``bench parallel``: the layer under Tutel's adaptive schedule at every fixed r, and where a node
  holds an MP group (2x2), under Parm's S1, S2 with SAA and the DeepSpeed-MoE baseline behind
  MP = 2 (N_ESP = N_MP, moeflow's layout);
- ``bench skew``: the dropless layer under Zipf-skewed routing, with and without FasterMoE's
  shadowing and smart schedule, with EPLB's redundant slots, and under ``balance='auto'`` (as the
  technique it chose), over the padded and the ragged exchange (at the degree, algorithm and
  shadowed experts each mode ran, on the per-expert load it recorded);
- ``bench exchange``: the layer over the padded, ragged and ``auto`` token exchange (the ragged
  kernel in each), dropless at Zipf(1.2) and at f = 1 under uniform load.

Each benchmark also times a speed probe (the reference FFN) in every round: the machine's rate
then over its rate at calibration re-times the twin's device (``simulated_ms``); the prediction of
the twin as calibrated is kept beside it (``as_calibrated_ms``).

One JSON line per measured setting with both times and the error, and per (layout, bandwidth,
config) the regret of the simulator's pick: the measured time of the setting the twin ranks first
over the measured best. Every measured record is kept in ``measured.jsonl`` beside the profiles,
so ``--replay`` scores a recorded run again (after a change to the simulator) without root.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moeflow.bench.exchange import ExchangePoint
from moeflow.bench.parallel import ParallelPoint
from moeflow.bench.pipeline import GridPoint
from moeflow.bench.schedules import SchedulePoint
from moeflow.bench.skew import SkewPoint
from moeflow.config import LayerDims
from moeflow.progress import Progress, Quiet

FIXED_SETTING = re.compile(r"d(\d+)-(\w+)")
LAYOUTS = ((2, 1), (2, 2))
BANDWIDTHS = (0.5, 1.0, 2.0)
GRID = (GridPoint(2048, 512, 256, 2, 2), GridPoint(2048, 512, 1024, 2, 2))
SCHEDULE_GRID = (SchedulePoint(4, 256), SchedulePoint(8, 1024))
PARALLEL_GRID = (ParallelPoint(1, 256, 1.0), ParallelPoint(1, 2048, 1.0), ParallelPoint(2, 256, 4.0),
                 ParallelPoint(2, 2048, 4.0))
PARM_GRID = (ParallelPoint(2, 256, 1.0, mp=2), ParallelPoint(2, 1024, 2.0, mp=2))
SKEW_GRID = (SkewPoint("zipf:1.5"), SkewPoint("zipf:1.2", 8, 1024, 2048, 512, 2, token_exchange="ragged"))
SIMULATED_SKEW_MODES = ("off", "hottest", "auto", "smart", "smart+auto", "redundant", "balance")
EXCHANGE_GRID = (ExchangePoint("zipf:1.2"), ExchangePoint("uniform", 1.0))
SIMULATED_EXCHANGE_MODES = ("padded", "ragged", "auto")  # not padded-bmm: the simulator runs f = 0 on real rows
BENCHES = ("pipeline", "schedules", "parallel", "skew", "exchange")
SIMULATED_PARM_MODES = {"s1": "s1", "s2-saa": "s2", "ds-baseline": "ds-baseline"}  # the sim's S2 is with SAA
MEASURED = "measured.jsonl"
CALIBRATIONS = 3  # the twin is built from their median
VOCABULARY = 512  # bench schedules' model (its LM head is part of a step)


def profile_path(folder: Path, layout: str, gbit: float) -> Path:
    return folder / f"profile-{layout}-{gbit:g}gbit.json"


def _pipeline(cluster: Any, record: dict[str, Any]) -> list[tuple[str, float, float]]:
    from moeflow.sim import ModelSpec, StepPlan, simulated_ms

    match = FIXED_SETTING.fullmatch(str(record.get("setting", "")))
    if match is None:
        return []
    point = GridPoint(**{k: record[k] for k in asdict(GRID[0])})
    dims = LayerDims(point.model_dim, point.hidden_dim, point.experts_per_rank * cluster.world_size,
                     top_k=point.top_k, bias=False)
    model = ModelSpec(name=point.name, layers=1, dims=dims, capacity_factor=1.0, tokens_per_rank=point.tokens,
                      dtype="fp32")
    plan = StepPlan(degree=int(match[1]), algorithm=match[2])
    return [(record["setting"], record["layer_ms"], simulated_ms(cluster, model, plan))]


def _schedules(cluster: Any, record: dict[str, Any]) -> list[tuple[str, float, float]]:
    """A training step (forward, backward, gradient all-reduce, AdamW) of bench schedules' model."""
    from moeflow.config import ALLTOALL_ALGORITHMS
    from moeflow.sim import ModelSpec, StepPlan, simulated_ms

    model = ModelSpec(name=record["config"], layers=1, dims=_recorded_dims(record, top_k=2), capacity_factor=1.0,
                      tokens_per_rank=record["batch"] * record["context"], sequence_length=record["context"],
                      dtype="fp32", vocab_size=VOCABULARY)
    if "expert_degree" in record:  # the plan the measured expert step ran
        ran = _pipeline_ran({"degree": record["expert_degree"], "alltoall": record["expert_alltoall"]})
        expert = simulated_ms(cluster, model, StepPlan(**ran), layer_only=False)
    else:  # recorded before bench schedules reported it: the twin's best
        expert = min(simulated_ms(cluster, model, StepPlan(degree=d, algorithm=a), layer_only=False)
                     for d in (1, 2, 4, 8) for a in ALLTOALL_ALGORITHMS if a in cluster.collective_scale)
    replicated = simulated_ms(cluster, model, StepPlan(schedule="replicated"), layer_only=False)
    return [("step-expert", record["expert_step_ms"], expert),
            ("step-replicated", record["replicated_step_ms"], replicated)]


def _recorded_dims(record: dict[str, Any], top_k: int | None = None) -> LayerDims:
    """A measured record's layer dims (its JSON keeps the benchmarks' keys, ``experts`` among them),
    without biases as the simulator counts them."""
    return LayerDims(record["model_dim"], record["hidden_dim"], record["experts"],
                     top_k=record["top_k"] if top_k is None else top_k, bias=False)


def _pipeline_ran(record: dict[str, Any]) -> dict[str, Any]:
    """The pipeline degree and all-to-all algorithm a measured setting ran, as the simulator's."""
    from moeflow.perf.sim.plan import simulated_algorithm

    return {"degree": max(1, int(record.get("degree") or 1)), "algorithm": simulated_algorithm(record.get("alltoall"))}


def _exchange_ran(token_exchange: str) -> dict[str, Any]:
    """The token exchange a measured setting ran, as the simulator's plan fields (``auto``: each
    chunk ragged where it leaves enough of its slots empty)."""
    from moeflow.config import PADDED, ragged_min_saving

    return {"ragged_exchange": token_exchange != PADDED, "ragged_min_saving": ragged_min_saving(token_exchange)}


def _parallel(cluster: Any, record: dict[str, Any]) -> list[tuple[str, float, float]]:
    """One layer's forward+backward under Tutel's adaptive schedule at a fixed r, or under one of
    Parm's schedules behind MP attention."""
    from moeflow.sim import ModelSpec, StepPlan, simulated_ms

    model = ModelSpec(name=record["config"], layers=1, dims=_recorded_dims(record),
                      capacity_factor=record["capacity_factor"], tokens_per_rank=record["tokens"], dtype="fp32")
    mode, mp = str(record.get("mode", "")), int(record.get("mp", 1))
    if mp > 1 and mode in SIMULATED_PARM_MODES:
        parm = StepPlan(schedule=SIMULATED_PARM_MODES[mode], mp=mp, esp=mp, **_pipeline_ran(record),
                        packed_s1=True)  # moeflow's S1 sends no empty slot
        return [(mode, record["layer_ms"], simulated_ms(cluster, model, parm))]
    if not mode.startswith("r") or record.get("r") is None:
        return []
    plan = StepPlan(schedule="adaptive", r=int(record["r"]), **_pipeline_ran(record))
    return [(f"adaptive-r{record['r']}", record["layer_ms"], simulated_ms(cluster, model, plan))]


def _skew(cluster: Any, record: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The dropless layer on the load the mode recorded (every rank's share of it), as the mode ran:
    its schedule, degree, algorithm and shadowed experts, its token exchange (a shadowed expert's
    slots travel, cut to the others' capacity, only in the padded one: ``moeflow.parallel.shadowing``)
    and EPLB's slots where it ran them (the redundant mode, or what ``balance='auto'`` chose)."""
    if record.get("mode") not in SIMULATED_SKEW_MODES:
        return []
    exchange = _exchange_ran(str(record.get("token_exchange", "padded")))
    ragged = exchange["ragged_exchange"]
    slots = int(record.get("slots") or record["experts"]) - record["experts"]
    if record.get("mode") == "redundant" and not slots:
        return []  # recorded before the records carried the slots
    plan = {"schedule": "smart" if record["schedule"] == "smart" else "expert", **_pipeline_ran(record),
            "shadowed": len(record["shadowed"]), "shadowed_slots_travel": not ragged, **exchange,
            "redundant_slots": slots,
            "padded_backward": "slots" not in record}  # recorded before 11-27: the kernel's padded backward
    return [(f"skew-{record['mode']}", record["layer_ms"], _dropless_layer_ms(cluster, record, plan))]


def _exchange(cluster: Any, record: dict[str, Any]) -> list[tuple[str, float, float]]:
    """A training step of the layer over the token exchange the mode sent (the ragged kernel), on
    the load it recorded."""
    if record.get("mode") not in SIMULATED_EXCHANGE_MODES or "tokens_per_expert" not in record:
        return []
    plan = {**_pipeline_ran(record), **_exchange_ran(record["token_exchange"])}
    return [(f"exchange-{record['mode']}", record["train_step_ms"], _dropless_layer_ms(cluster, record, plan))]


def _dropless_layer_ms(cluster: Any, record: dict[str, Any], plan: dict[str, Any]) -> float:
    """The layer's forward + backward (ms) at the record's shape, capacity factor and recorded load
    (every rank's share of it), under ``plan``'s StepPlan settings."""
    import numpy as np

    from moeflow.sim import LayerLoad, ModelSpec, StepPlan, simulate_step

    model = ModelSpec(name=record["config"], layers=1, dims=_recorded_dims(record),
                      capacity_factor=float(record.get("capacity_factor", 0.0)), tokens_per_rank=record["tokens"],
                      dtype="fp32")
    counts = np.asarray(record["tokens_per_expert"], dtype=np.float64) / cluster.world_size
    load = LayerLoad(np.broadcast_to(counts, (cluster.world_size, model.dims.num_experts)))
    return simulate_step(cluster, model, StepPlan(**plan), loads=[load], layer_only=True).step_s * 1e3


PREDICTORS = {"pipeline": _pipeline, "schedules": _schedules, "parallel": _parallel, "skew": _skew,
              "exchange": _exchange}


def compare(measured: list[dict[str, Any]], profile: Path, layout: str, gbit: float) -> list[dict[str, Any]]:
    """One record per measured fixed setting, with the twin's time beside it: ``simulated_ms`` on
    the twin re-timed to the speed probe its benchmark ran beside it (when it has one),
    ``as_calibrated_ms`` on the twin as calibrated."""
    from moeflow.perf.profile import ClusterProfile
    from moeflow.sim.calibrated import cluster_from_profile, retimed

    calibrated = ClusterProfile.load(profile)  # read once: the twin and the probe's expected time
    cluster, out = cluster_from_profile(calibrated, profile.stem), []
    expected = calibrated.speed_probe_seconds()
    probes = {(r["measured_by"], r["config"]): r["probe_ms"] for r in measured if r.get("bench") == "speed-probe"}
    for record in measured:
        predict = PREDICTORS.get(str(record.get("bench")))
        if predict is None:
            continue
        probe = probes.get((record["bench"], record["config"]))
        speed = expected * 1e3 / probe if probe and expected else None
        twin = retimed(cluster, speed) if speed else cluster
        raw = {setting: predicted for setting, _, predicted in predict(cluster, record)} if speed else {}
        for setting, measured_ms, predicted_ms in predict(twin, record):
            drifted = raw.get(setting, predicted_ms)
            out.append({"bench": "sim-validation", "measured_by": record["bench"], "layout": layout,
                        "inter_gbit": gbit, "config": record["config"], "setting": setting,
                        "measured_ms": round(measured_ms, 3), "simulated_ms": round(predicted_ms, 3),
                        "error": round(predicted_ms / measured_ms - 1, 4),
                        "speed": None if speed is None else round(speed, 4),
                        "as_calibrated_ms": round(drifted, 3),
                        "as_calibrated_error": round(drifted / measured_ms - 1, 4)})
    return out


def regrets(records: list[dict[str, Any]]) -> list[float]:
    """Per (layout, bandwidth, config): the measured time of the twin's pick over the measured best."""
    out = []
    for key in sorted({(r["layout"], r["inter_gbit"], r["config"]) for r in records}):
        group = [r for r in records if (r["layout"], r["inter_gbit"], r["config"]) == key]
        picked = min(group, key=lambda r: r["simulated_ms"])
        out.append(picked["measured_ms"] / min(r["measured_ms"] for r in group) - 1)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and max |error| (all, and per layout and per benchmark), and the pick's regret."""
    def errors(subset: list[dict[str, Any]]) -> dict[str, Any]:
        values = [abs(r["error"]) for r in subset]
        return {"points": len(values), "median_abs_error": statistics.median(values) if values else None,
                "max_abs_error": max(values, default=None)}

    found = regrets(records)
    drift = [abs(r.get("as_calibrated_error", r["error"])) for r in records]
    return {"summary": "sim-validation", **errors(records),
            "as_calibrated": {"median_abs_error": statistics.median(drift) if drift else None,
                              "max_abs_error": max(drift, default=None)},
            "median_regret": statistics.median(found) if found else None, "max_regret": max(found, default=None),
            "by_layout": {k: errors([r for r in records if r["layout"] == k]) for k in sorted({r["layout"]
                                                                                            for r in records})},
            "by_bench": {k: errors([r for r in records if r.get("measured_by") == k])
                         for k in sorted({r.get("measured_by", "pipeline") for r in records})}}


def replay(folder: Path) -> list[dict[str, Any]]:
    """Score a recorded run: ``folder`` holds ``measured.jsonl`` and the profiles it was measured on."""
    lines = (folder / MEASURED).read_text().splitlines()
    measured = [json.loads(line) for line in lines if line.strip()]
    records = []
    for key in sorted({(f"{r['nodes']}x{r['ranks_per_node']}", r["inter_gbit"]) for r in measured}):
        subset = [r for r in measured if (f"{r['nodes']}x{r['ranks_per_node']}", r["inter_gbit"]) == key]
        records += compare(subset, profile_path(folder, *key), *key)
    return records


def calibrated(folder: Path, layout: str, nodes: int, per_node: int, gbit: float,
               progress: Progress | None = None) -> Path:
    """The median of ``CALIBRATIONS`` calibrations of the cluster (each kept beside it);
    ``progress`` counts them."""
    from moeflow.bench import run_on_cluster
    from moeflow.perf.profile import ClusterProfile, median_profile

    runs, progress = [], progress or Quiet()
    for index in range(CALIBRATIONS):
        progress.note(f"{layout} {gbit:g} Gbit/s: calibration {index + 1}/{CALIBRATIONS}")
        path = folder / f"calibration-{layout}-{gbit:g}gbit-{index}.json"
        run_on_cluster("moeflow.bench.pipeline", "calibration", [], nodes, per_node, gbit, 1, None, 29760, 600,
                       save_profile=str(path))
        runs.append(ClusterProfile.load(path))
        progress.advance()
    path = profile_path(folder, layout, gbit)
    median_profile(runs).save(path)
    return path


def _bench_grids(grid: list[GridPoint], per_node: int, benches: tuple[str, ...]) -> list[tuple[str, list[Any]]]:
    """Each of ``benches`` with the points it measures on a cluster of ``per_node`` ranks a node."""
    parallel = PARALLEL_GRID + (PARM_GRID if per_node % 2 == 0 else ())  # an MP group inside a node
    grids = {"pipeline": grid, "schedules": SCHEDULE_GRID, "parallel": parallel, "skew": SKEW_GRID,
             "exchange": EXCHANGE_GRID}
    return [(name, list(grids[name])) for name in benches]


def _items(grid: list[GridPoint], per_node: int, benches: tuple[str, ...]) -> int:
    """What a run's progress counts at one (layout, bandwidth): its calibrations and grid points."""
    return CALIBRATIONS + sum(len(points) for _, points in _bench_grids(grid, per_node, benches))


class _GridPoints:
    """``progress`` for one benchmark's grid in a run expected up front: its own ``expect`` adds
    nothing; it counts the points its ranks reported done."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.done = progress, 0

    def expect(self, items: int) -> None:
        """Expected already."""

    def advance(self, items: int = 1) -> None:
        self.done += items
        self.progress.advance(items)

    def note(self, text: str) -> None:
        self.progress.note(text)


def run(layouts: tuple[tuple[int, int], ...], bandwidths: tuple[float, ...], grid: list[GridPoint], repeats: int,
        folder: Path, emit: Any, benches: tuple[str, ...] = BENCHES,
        progress: Progress | None = None) -> list[dict[str, Any]]:
    """Measure and simulate ``benches`` on every (layout, bandwidth); profiles and measurements are
    kept in ``folder``. ``progress`` counts the calibrations and the grid points measured."""
    from moeflow.bench import run_on_cluster

    progress = progress or Quiet()
    progress.expect(len(bandwidths) * sum(_items(grid, per_node, benches) for _, per_node in layouts))
    records: list[dict[str, Any]] = []
    for (nodes, per_node), gbit in ((layout, gbit) for layout in layouts for gbit in bandwidths):
        layout = f"{nodes}x{per_node}"
        profile = calibrated(folder, layout, nodes, per_node, gbit, progress)
        measured = []
        for module, points in _bench_grids(grid, per_node, benches):
            progress.note(f"{layout} {gbit:g} Gbit/s: {module}")
            reported = _GridPoints(progress)
            measured += run_on_cluster(f"moeflow.bench.{module}", module, points, nodes, per_node, gbit,
                                       repeats, str(profile), 29760, 3600, progress=reported)
            progress.advance(len(points) - reported.done)  # points a run did not report (it ended early)
        with (folder / MEASURED).open("a") as sink:
            sink.writelines(json.dumps(r) + "\n" for r in measured)
        for record in compare(measured, profile, layout, gbit):
            emit(record)
            records.append(record)
    return records


def scatter(records: list[dict[str, Any]], path: Path) -> Path:
    """Simulated against measured time, log-log, one colour per benchmark, with the y = x line and
    the issue's +-25 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.0, 5.2))
    colors = {"pipeline": "#4C72B0", "schedules": "#DD8452", "parallel": "#55A868", "skew": "#C44E52",
              "exchange": "#8172B3"}
    for bench, color in colors.items():
        for layout, marker in (("2x1", "o"), ("2x2", "^")):
            chosen = [r for r in records if r.get("measured_by", "pipeline") == bench and r["layout"] == layout]
            if chosen:
                axis.scatter([r["measured_ms"] for r in chosen], [r["simulated_ms"] for r in chosen], s=18,
                             color=color, marker=marker, alpha=0.75, label=f"{bench} {layout}")
    low = min(min(r["measured_ms"], r["simulated_ms"]) for r in records) * 0.8
    high = max(max(r["measured_ms"], r["simulated_ms"]) for r in records) * 1.25
    axis.plot([low, high], [low, high], color="black", linewidth=1)
    axis.fill_between([low, high], [0.75 * low, 0.75 * high], [1.25 * low, 1.25 * high], color="grey", alpha=0.15,
                      label="+-25 %")
    axis.set(xscale="log", yscale="log", xlabel="measured (ms)", ylabel="simulated on the calibrated twin (ms)",
             title="moeflow.sim vs the emulated cluster")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)  # the trainer's report resolution
    plt.close(figure)
    return path
