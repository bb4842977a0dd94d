"""``moeflow bench papers``: the papers' trends at their scale, simulated on their cluster profiles,
side by side with the numbers they publish (one JSON line per cell, a summary per table, plots).

- Tutel Table 6 (a): adaptive pipelining (best degree and all-to-all per config) over each static
  (degree, algorithm), averaged over configs, at 16..256 A100s;
- Tutel Fig. 14: 2DH over linear and adaptive pipelining over 2DH, one layer at 16..2,048 A100s;
- PipeMoE Table VI: the best degree over fixed degrees 1, 2, 4, 8 at 16..64 RTX 2080 Ti;
- FasterMoE Fig. 13: shadowing, smart scheduling and both over plain expert parallelism (johnny);
- Lina section 2.2: the backward all-to-all's slowdown under the gradient all-reduce (its median
  and worst over the ops of a step), and the step with all-to-alls prioritized;
- Parm Table IV: S1, S2 and Parm (the better of the two per layer) over the DeepSpeed-MoE baseline,
  averaged over configured layers, on Testbed A (8 RTX 4090) and B (8..32 RTX 2080 Ti).

The config grids are the papers' own where the simulator models them, thinned where noted; a
paper's figure that has no number in its text is not compared.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moeflow.config import LayerDims

Row = dict[str, Any]
DDP_BUCKET_MB = 25.0  # PyTorch DDP's default bucket_cap_mb

TUTEL_TABLE6 = {  # GPUs -> (algorithm, degree) -> average improvement of adaptive (Tutel Table 6a)
    16: {("linear", 1): .20, ("linear", 2): .02, ("linear", 4): .02, ("linear", 8): .11,
         ("2dh", 1): 1.01, ("2dh", 2): .98, ("2dh", 4): 1.00, ("2dh", 8): 1.06},
    64: {("linear", 1): .13, ("linear", 2): .01, ("linear", 4): .05, ("linear", 8): .15,
         ("2dh", 1): .28, ("2dh", 2): .25, ("2dh", 4): .27, ("2dh", 8): .34},
    256: {("linear", 1): .20, ("linear", 2): .27, ("linear", 4): .54, ("linear", 8): 1.07,
          ("2dh", 1): .12, ("2dh", 2): .20, ("2dh", 4): .34, ("2dh", 8): .11},
}
TUTEL_FIG14 = {("2dh over linear", 2048): 4.25, ("adaptive over 2dh", 16): 1.43, ("adaptive over 2dh", 2048): 1.04}
PIPEMOE_TABLE6 = {16: {1: .168, 2: .115, 4: .034, 8: .086}, 32: {1: .156, 2: .035, 4: .061, 8: .129},
                  64: {1: .125, 2: .053, 4: .086, 8: .172}}
FASTERMOE_FIG13 = {"shadowing": 1.95, "smart": 1.40, "both": 2.20}  # johnny, "up to" over its models
PARM_TABLE4 = {  # (N_MP, N_ESP) -> schedule -> speedup on (T-A, T-B 8, T-B 16, T-B 32 GPUs)
    (2, 2): {"s1": (2.10, 2.62, 2.46, 2.72), "s2": (1.99, 2.42, 2.20, 2.57), "parm": (2.10, 2.62, 2.46, 2.57)},
    (2, 4): {"s1": (2.24, 3.37, 2.85, 2.85), "s2": (2.41, 3.05, 2.44, 2.75), "parm": (2.41, 3.37, 2.85, 2.85)},
    (4, 2): {"s1": (3.72, 4.18, 4.12, 3.92), "s2": (3.21, 3.58, 3.81, 4.10), "parm": (3.70, 4.18, 4.12, 4.06)},
    (4, 4): {"s1": (4.19, 5.77, 5.08, 4.57), "s2": (4.12, 5.38, 4.82, 4.91), "parm": (4.20, 5.77, 5.08, 4.91)},
}
PARM_TESTBEDS = (("T-A", "parm-4090", 8), ("T-B", "parm-2080ti", 8), ("T-B", "parm-2080ti", 16),
                 ("T-B", "parm-2080ti", 32))
LINA = {"median slowdown of those": 1.83, "worst backward all-to-all slowdown": 4.14,
        "step speedup, priority with tensor partitioning (16 experts)": 1.42}
"""Lina §2.2: the CDF of the slowdown "they endure with allreduce" of backward all-to-alls that
overlap one ("as the two operations overlap, they contend"): median 1.83x, worst 4.14x. §7.2.2: priority
with tensor partitioning cuts the step 1.42x at 16 experts (priority alone, which NCCL cannot preempt,
24 % on average); the simulator's prioritized all-to-all preempts at every event, as partitioning does."""


def _row(paper: str, table: str, cell: str, simulated: float, published: float | None) -> Row:
    return {"bench": "papers", "paper": paper, "table": table, "cell": cell, "simulated": round(simulated, 4),
            "published": published,
            "simulated_over_published": round(simulated / published, 3) if published else None}


def tutel_table6() -> Iterator[Row]:
    """Grid thinned from Table 6's 3^4: E_g in {1, 2} (E_g = 0.5 needs sharded experts), D and H in
    {1024, 4096}, tokens/step per GPU in {4096, 16384}, f = 1, top-2, fp16."""
    from moeflow.sim import ModelSpec, StepPlan, load_cluster, simulated_ms

    base = load_cluster("tutel-a100")
    statics = [(a, d) for a in ("linear", "2dh") for d in (1, 2, 4, 8)]
    for gpus, published in TUTEL_TABLE6.items():
        cluster = base.resized(gpus // base.gpus_per_node)
        gains: dict[tuple[str, int], list[float]] = {s: [] for s in statics}
        for per_gpu, dim, hidden, tokens in itertools.product((1, 2), (1024, 4096), (1024, 4096), (4096, 16384)):
            model = ModelSpec(layers=1, dims=LayerDims(dim, hidden, per_gpu * gpus, bias=False),
                              tokens_per_rank=tokens, capacity_factor=1.0)
            times = {s: simulated_ms(cluster, model, StepPlan(degree=s[1], algorithm=s[0])) for s in statics}
            best = min(times.values())
            for s in statics:
                gains[s].append(times[s] / best - 1)
        for s in statics:
            yield _row("tutel", "Table 6a", f"{gpus} GPUs {s[0]} d={s[1]}", statistics.mean(gains[s]), published[s])


def tutel_fig14() -> Iterator[Row]:
    """One layer (tutel-fig14: D = H = 2048, 2 experts per GPU, 16,384 tokens per GPU, f = 1)."""
    from moeflow.sim import StepPlan, load_cluster, load_model, simulated_ms

    base, model = load_cluster("tutel-a100"), load_model("tutel-fig14")
    for gpus in (16, 128, 2048):
        cluster = base.resized(gpus // base.gpus_per_node)
        sized = model.with_overrides(num_experts=2 * gpus)
        linear = simulated_ms(cluster, sized, StepPlan(algorithm="linear"))
        two_dim = simulated_ms(cluster, sized, StepPlan(algorithm="2dh"))
        adaptive = min(simulated_ms(cluster, sized, StepPlan(degree=d, algorithm=a))
                       for d in (1, 2, 4, 8) for a in ("linear", "2dh"))
        yield _row("tutel", "Fig. 14", f"{gpus} GPUs 2dh over linear", linear / two_dim,
                   TUTEL_FIG14.get(("2dh over linear", gpus)))
        yield _row("tutel", "Fig. 14", f"{gpus} GPUs adaptive over 2dh", two_dim / adaptive,
                   TUTEL_FIG14.get(("adaptive over 2dh", gpus)))


PIPEMOE_FIG6 = MappingProxyType({"gemm": (6.19e-5, 4.1e-14), 16: (1.72e-5, 2.96e-10), 32: (2.09e-4, 3.54e-10),
                                 64: (7.83e-4, 3.84e-10)})
"""PipeMoE Fig. 6's fits, (alpha, beta): the GEMM (a), and the linear all-to-all at 16, 32 and 64 GPUs (b)."""


def pipemoe_pick(gpus: int, per_node: int, model: Any) -> int:
    """The degree PipeMoE runs: the minimum of its recurrences (Eq. 9-12) on its own Fig. 6 fits,
    forward and backward, over degrees 1..16 (Algorithm 1's choice where Theorem 1 holds)."""
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
    from moeflow.perf.pipeline import rank_plans
    from moeflow.perf.shape import RegionShape

    fits = {"gemm": AlphaBeta(*PIPEMOE_FIG6["gemm"]), "alltoall.linear": AlphaBeta(*PIPEMOE_FIG6[gpus])}
    cost = CostModel(ClusterProfile(nodes=gpus // per_node, ranks_per_node=per_node, fits=fits))
    shape = RegionShape.for_tokens(model.dims, model.tokens_per_rank, model.capacity_factor, gpus,
                                   bytes_per_element=model.element_bytes)
    return rank_plans(cost, shape, range(1, 17), ["linear"])[0].degree


def pipemoe_table6() -> Iterator[Row]:
    """Grid thinned from Table IV: B x L in {2048, 8192} tokens, M and H in {1024, 4096, 8192},
    E/P in {1, 2}; fp16 (the GEMM fit's rate), f = 1, top-1 (Alg. 1's n_d). PipeMoE runs the degree
    its own model picks on its Fig. 6 fits (:func:`pipemoe_pick`), Tutel a fixed degree, both on
    linear all-to-all; each simulated."""
    from moeflow.sim import ModelSpec, StepPlan, load_cluster, simulated_ms

    base = load_cluster("pipemoe-2080ti")
    for gpus, published in PIPEMOE_TABLE6.items():
        cluster = base.resized(gpus // base.gpus_per_node)
        gains: dict[int, list[float]] = {d: [] for d in published}
        for tokens, dim, hidden, per_gpu in itertools.product((2048, 8192), (1024, 4096, 8192), (1024, 4096, 8192),
                                                              (1, 2)):
            model = ModelSpec(layers=1, dims=LayerDims(dim, hidden, per_gpu * gpus, top_k=1, bias=False),
                              tokens_per_rank=tokens, capacity_factor=1.0)
            picked = simulated_ms(cluster, model, StepPlan(degree=pipemoe_pick(gpus, base.gpus_per_node, model)))
            for d in gains:
                gains[d].append(simulated_ms(cluster, model, StepPlan(degree=d)) / picked - 1)
        for d, values in gains.items():
            yield _row("pipemoe", "Table VI", f"{gpus} GPUs r={d}", statistics.mean(values), published[d])


FASTERMOE_JOHNNY_MODELS = (("GPT-S", 12, 1024), ("GPT", 12, 2048), ("GPT-L", 12, 4096), ("BERT-Deep", 24, 1024),
                           ("BERT-Deep-L", 24, 4096))
"""FasterMoE Table 2's models trained on johnny: name, layers, H (16 experts, FFN 2H)."""


def fastermoe_fig13() -> Iterator[Row]:
    """Table 2's johnny models (GPT-S/GPT/GPT-L, BERT-Deep/-L) with zipf 0.7 routing (its 3.2x hot
    expert). As §5.2 measures, the MoE layers alone, forward and backward. Shadowing shadows the
    number of hottest experts (0 to 4 per layer; §5.5: 19 % of the experts on average) that runs
    fastest, as Algorithm 1 decides. The paper gives maxima only ("up to"): each row's published
    figure is that maximum, to compare against the largest simulated one."""
    from moeflow.sim import StepPlan, load_cluster, load_model, simulated_ms

    cluster, base = load_cluster("fastermoe-johnny"), load_model("fastermoe-gpt")
    plans = {"shadowing": [StepPlan(shadowed=s) for s in range(1, 5)], "smart": [StepPlan(schedule="smart")],
             "both": [StepPlan(schedule="smart", shadowed=s) for s in range(1, 5)]}
    best = dict.fromkeys(plans, 0.0)
    for name, layers, dim in FASTERMOE_JOHNNY_MODELS:
        model = base.with_overrides(layers=layers, model_dim=dim, hidden_dim=2 * dim)
        plain = simulated_ms(cluster, model, StepPlan())
        for label, candidates in plans.items():
            speedup = plain / min(simulated_ms(cluster, model, plan) for plan in candidates)
            best[label] = max(best[label], speedup)
            yield _row("fastermoe", "Fig. 13", f"{name} {label}", speedup, None)
    for label, value in best.items():
        yield _row("fastermoe", "Fig. 13", f"max over models {label}", value, FASTERMOE_FIG13[label])


def lina_contention() -> Iterator[Row]:
    """A 12-layer GPT-2-sized MoE (M = 768, H = 3072, 16 experts, top-2, 2,048 tokens per GPU, fp16,
    gradients all-reduced in DDP's default 25 MB buckets) on lina-a100: each backward all-to-all's
    time beside the gradient all-reduce over its time with all-to-alls served first (as if alone),
    and the step time of the two. Lina's batch and bucket size are not in its text."""
    import numpy as np

    from moeflow.sim import ModelSpec, StepPlan, load_cluster, routing_loads
    from moeflow.sim.step import step_builder

    cluster = load_cluster("lina-a100")
    model = ModelSpec(layers=12, dims=LayerDims(768, 3072, 16, bias=False), tokens_per_rank=2048,
                      sequence_length=1024, vocab_size=50257)
    loads = routing_loads(model, cluster.world_size)
    runs = {}
    for prioritized in (False, True):
        builder = step_builder(cluster, model, StepPlan(prioritize_alltoall=prioritized, bucket_mb=DDP_BUCKET_MB))
        timeline = builder.build(loads).run()
        ops = [i for i, op in enumerate(timeline.ops) if i >= builder.forward_ops and op.category == "alltoall"]
        runs[prioritized] = (timeline.makespan(), np.array([float(timeline.finish[i]) - float(timeline.start[i])
                                                            for i in ops]))
    slowdown = runs[False][1] / np.maximum(runs[True][1], 1e-12)
    yield _row("lina", "section 2.2", "median backward all-to-all slowdown", float(np.median(slowdown)), None)
    yield _row("lina", "section 2.2", "worst backward all-to-all slowdown", float(slowdown.max()),
               LINA["worst backward all-to-all slowdown"])
    slowed = slowdown[slowdown > 1.01]
    yield _row("lina", "section 2.2", "share of backward all-to-alls beside an all-reduce", len(slowed) / len(slowdown),
               None)
    yield _row("lina", "section 2.2", "median slowdown of those", float(np.median(slowed)) if len(slowed) else 1.0,
               LINA["median slowdown of those"])
    yield _row("lina", "section 7.2", "step speedup, priority with tensor partitioning (16 experts)",
               runs[False][0] / runs[True][0], LINA["step speedup, priority with tensor partitioning (16 experts)"])


def parm_table4() -> Iterator[Row]:
    """Table III's grid, thinned: B in {2, 8}, L in {512, 2048}, H / N_ESP and M / N_ESP in
    {1024, 4096}, f in {1.2, 2.4}; top-1 and one expert per EP rank (E = P / N_ESP; Table III gives
    neither), fp32; the MoE layer alone, forward and backward, gradient all-reduce excluded as in
    Parm. Parm's own rule picks per layer from its alpha-beta model; here "parm" is the better of
    the two simulated schedules. Configs that do not fit a GPU's memory are not removed."""
    from moeflow.sim import ModelSpec, StepPlan, load_cluster, simulated_ms

    for (mp, esp), published in PARM_TABLE4.items():
        for column, (testbed, profile, gpus) in enumerate(PARM_TESTBEDS):
            base = load_cluster(profile)
            cluster = base.resized(gpus // base.gpus_per_node)
            gains: dict[str, list[float]] = {name: [] for name in published}
            for batch, length, hidden, dim, factor in itertools.product((2, 8), (512, 2048), (1024, 4096),
                                                                        (1024, 4096), (1.2, 2.4)):
                dims = LayerDims(dim * esp, hidden * esp, gpus // esp, top_k=1, bias=False)
                model = ModelSpec(layers=1, dims=dims, capacity_factor=factor, tokens_per_rank=batch * length,
                                  sequence_length=length, dtype="fp32")
                times = {name: simulated_ms(cluster, model, StepPlan(schedule=name, mp=mp, esp=esp))
                         for name in ("ds-baseline", "s1", "s2")}
                times["parm"] = min(times["s1"], times["s2"])
                for name, values in gains.items():
                    values.append(times["ds-baseline"] / times[name])
            for name, values in gains.items():
                yield _row("parm", "Table IV", f"{testbed} {gpus} GPUs {name} mp={mp} esp={esp}",
                           statistics.mean(values), published[name][column])


TRENDS: dict[str, Callable[[], Iterator[Row]]] = {
    "tutel-table6": tutel_table6, "tutel-fig14": tutel_fig14, "pipemoe-table6": pipemoe_table6,
    "fastermoe-fig13": fastermoe_fig13, "lina-contention": lina_contention, "parm-table4": parm_table4,
}


MEDIAN_BAND = (0.85, 1.15)
"""The band each table's median simulated/published ratio should lie in (issue 64's target)."""
CELL_BAND = (0.75, 1.33)
"""The band 80 % of a table's cells should lie in."""


def summarize(rows: list[Row]) -> dict[str, Any]:
    """Per table: the cells compared, the median and worst simulated/published ratio, the share of
    cells inside :data:`CELL_BAND`, and whether the median lies in :data:`MEDIAN_BAND`."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r["paper"], r["table"]) for r in rows):
        ratios = [r["simulated_over_published"] for r in rows
                  if (r["paper"], r["table"]) == key and r["simulated_over_published"] is not None]
        if not ratios:
            continue
        median = statistics.median(ratios)
        inside = sum(CELL_BAND[0] <= ratio <= CELL_BAND[1] for ratio in ratios) / len(ratios)
        out[" ".join(key)] = {"cells": len(ratios), "median_ratio": median, "min_ratio": min(ratios),
                              "max_ratio": max(ratios), "share_within_cell_band": round(inside, 3),
                              "median_within_band": MEDIAN_BAND[0] <= median <= MEDIAN_BAND[1]}
    return {"summary": "papers", "tables": out,
            "tables_meeting_both": sum(t["median_within_band"] and t["share_within_cell_band"] >= 0.8
                                       for t in out.values())}


def plot(rows: list[Row], folder: Path) -> list[Path]:
    """One bar chart per table: simulated beside published, cell by cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    for paper, table in dict.fromkeys((r["paper"], r["table"]) for r in rows):
        cells = [r for r in rows if (r["paper"], r["table"]) == (paper, table) and r["published"] is not None]
        if not cells:
            continue
        figure, axis = plt.subplots(figsize=(max(6.0, 0.45 * len(cells) + 2), 4.2))
        x = np.arange(len(cells))
        axis.bar(x - 0.2, [r["published"] for r in cells], 0.4, label="published", color="#4C72B0")
        axis.bar(x + 0.2, [r["simulated"] for r in cells], 0.4, label="simulated", color="#DD8452")
        axis.set_xticks(x, [r["cell"] for r in cells], rotation=60, ha="right", fontsize=7)
        axis.set_title(f"{paper} {table}: simulated on its cluster profile vs published")
        axis.legend()
        path = folder / f"papers-{paper}-{table.replace(' ', '').replace('.', '').lower()}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=110)  # the trainer's report resolution
        plt.close(figure)
        paths.append(path)
    return paths
