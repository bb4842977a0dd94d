"""The run's plots, from ``metrics.jsonl`` alone (``moeflow report RUN_DIR`` regenerates them):

- ``loss.png``: training loss (raw and smoothed), validation loss, and the corpus's unigram entropy;
- ``expert_load.png``: per MoE layer, each expert's share of the routed tokens over the steps;
- ``shadowed_experts.png``: beside it, per MoE layer, the experts FasterMoE shadowed at each step
  (its Fig. 11; only when some step shadowed one);
- ``load_heatmap.png``: the load of every MoE layer on one scale, one row per layer over the steps,
  white where an expert gets its uniform share;
- ``time_breakdown.png``: where a step's time goes (attention, routing, all-to-all, experts, ...),
  with the warm-up and the planner's trial steps shaded and left out of the mean shares;
- ``timeline.png``: one step on rank 0 from ``timeline.json`` (forward and backward, expert chunks,
  all-to-alls, gradient all-reduces: Lina's Fig. 7/8), with the all-to-all time spent beside an
  all-reduce over the run (``comm_s`` of ``metrics.jsonl``);
- ``report.html``: all of the above on one page with the run's tables (:mod:`moeflow.training.report_html`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from moeflow.files import json_text
from moeflow.models.transformer import moe_non_gemm_share
from moeflow.training.metrics import TIMELINE, iterate_records
from moeflow.training.plan_file import measured_against_plan
from moeflow.training.report_html import step_spans, write_html

PHASE_COLORS = {
    "attention": "#4C72B0", "routing": "#DD8452", "all_to_all": "#C44E52", "experts": "#55A868",
    "dense_ffn": "#8172B3", "other": "#937860", "grad_sync": "#DA8BC3", "optimizer": "#8C8C8C", "data": "#CCB974",
}


PLANNER_SEARCH_SOURCES = ("warmup", "trial")
"""The ``plan_source`` of a layer while the online planner searches (its untimed first call and its
timed candidates, :mod:`moeflow.parallel.online_planner`): such a step runs a candidate plan, not the run's."""
SETTLED_FACTOR = 1.5
"""A run's step time has settled at its first step (after step 1) within this factor of the median step."""


def _smooth(values: np.ndarray, weight: float = 0.9) -> np.ndarray:
    """Exponential smoothing with Adam's bias correction: the running mean starts at zero and is divided
    by ``1 - weight**n`` after ``n`` values, so the first value is not an anchor the curve drags along
    (a 3 s warm-up step still drew 0.5 s at step 24 of 0.3 s steps). A NaN (a skipped step's missing
    loss) leaves the curve where it was; before the first value it is NaN."""
    out, running, seen = np.full(len(values), np.nan), 0.0, 0
    for i, value in enumerate(values):
        if not np.isnan(value):
            running, seen = weight * running + (1 - weight) * value, seen + 1
        if seen:
            out[i] = running / (1 - weight**seen)
    return out


def warmup_steps(records: list[dict[str, Any]]) -> list[int]:
    """The steps before the step time settles (at least step 1: it builds buffers and caches), by
    ``step_s`` against the run's median (:data:`SETTLED_FACTOR`)."""
    times = [r.get("step_s") for r in records]
    known = [t for t in times if t is not None]
    if not known:
        return [records[0]["step"]]
    limit = SETTLED_FACTOR * float(np.median(known))
    settled = next((i for i, t in enumerate(times) if i >= 1 and t is not None and t <= limit), len(records))
    return [r["step"] for r in records[:settled]]


def trial_steps(records: list[dict[str, Any]]) -> list[int]:
    """The steps where some MoE layer ran a plan the online planner was trying (:data:`PLANNER_SEARCH_SOURCES`)."""
    return [r["step"] for r in records
            if any(layer.get("plan_source") in PLANNER_SEARCH_SOURCES for layer in r.get("moe", []))]


def excluded_steps(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The steps that do not show the run's steady pace: the warm-up and the planner's trials."""
    return {"warm_up": warmup_steps(records), "planner_trials": trial_steps(records)}


def kept_records(records: list[dict[str, Any]], excluded: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The steps the time shares average over: all but the excluded ones (all of them, if none is left)."""
    left_out = {step for steps in excluded.values() for step in steps}
    return [r for r in records if r["step"] not in left_out] or records


def summarize(records: list[dict[str, Any]], corpus: dict[str, Any] | None) -> dict[str, Any]:
    """The numbers a reader wants first: last losses against the unigram baseline, throughput,
    the time shares, and the MoE layers' share of time outside the expert GEMMs. The shares leave
    out the warm-up and the planner's trial steps (``excluded_steps``), which are not the run's pace."""
    vals = [r for r in records if "val_loss" in r]
    excluded = excluded_steps(records)
    kept = kept_records(records, excluded)
    times = [r["time_s"] for r in kept]
    step_s = [r["step_s"] for r in kept if r.get("step_s") is not None]
    mean_time = {k: float(np.mean([t.get(k, 0.0) for t in times])) for k in PHASE_COLORS}
    return {
        "steps": records[-1]["step"],
        "loss": records[-1]["loss"],
        "val_loss": vals[-1]["val_loss"] if vals else None,
        "unigram_entropy": corpus["unigram_entropy"] if corpus else None,
        "unigram_val_loss": corpus["unigram_val_loss"] if corpus else None,
        "median_tokens_per_s": float(np.median([r["tokens_per_s"] for r in records])),
        "median_step_s": float(np.median(step_s)) if step_s else None,
        "time_share": {k: v / max(sum(mean_time.values()), 1e-12) for k, v in mean_time.items()},
        "moe_non_gemm_share": moe_non_gemm_share(mean_time),
        "dropped_last_step": sum(layer["dropped"] for layer in records[-1].get("moe", [])),
        "shadowed_steps": sum(any(layer.get("shadowed") for layer in r.get("moe", [])) for r in records),
        "excluded_steps": excluded,
        **_contention(records),
    }


def _contention(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the run: the share of all-to-all time spent beside a gradient all-reduce, and the
    median seconds of one all-to-all alone and beside one (Lina's slowdown, §2.2)."""
    comm = [r["comm_s"] for r in records if "comm_s" in r]
    if not comm:
        return {}
    alone, beside = sum(c["all_to_all_alone"] for c in comm), sum(c["all_to_all_with_allreduce"] for c in comm)

    def per_op(seconds: str, ops: str) -> float | None:
        values = [c[seconds] / c[ops] for c in comm if c[ops]]
        return float(np.median(values)) if values else None

    return {
        "alltoall_share_beside_allreduce": beside / (alone + beside) if alone + beside else None,
        "alltoall_median_s_alone": per_op("all_to_all_alone", "all_to_all_alone_ops"),
        "alltoall_median_s_beside_allreduce": per_op("all_to_all_with_allreduce", "all_to_all_with_allreduce_ops"),
    }


def write_report(run_dir: Path) -> dict[str, Any]:
    """Write the PNGs, ``summary.json`` and ``report.html`` into ``run_dir``; return the summary."""
    import matplotlib

    matplotlib.use("Agg")
    records = list(iterate_records(run_dir))
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no steps yet")
    corpus_path = run_dir / "corpus.json"
    corpus = json.loads(corpus_path.read_text()) if corpus_path.exists() else None
    summary = summarize(records, corpus)
    planned = measured_against_plan(run_dir, kept_records(records, summary["excluded_steps"]))
    if planned is not None:
        summary["plan"] = planned
    _plot_loss(run_dir, records, corpus)
    _plot_expert_load(run_dir, records)
    _plot_load_heatmap(run_dir, records)
    _plot_shadowed_experts(run_dir, records, summary["shadowed_steps"])
    _plot_time_breakdown(run_dir, records, summary["time_share"], summary["excluded_steps"])
    if (run_dir / TIMELINE).exists():
        _plot_timeline(run_dir, json.loads((run_dir / TIMELINE).read_text()), records)
    (run_dir / "summary.json").write_text(json_text(summary, indent=2) + "\n")
    write_html(run_dir, records, summary)
    return summary


def _save(figure: Any, path: Path, tight: bool = True) -> None:
    import matplotlib.pyplot as plt

    if tight:  # a figure laid out by its own engine (constrained, for a shared colour bar) keeps it
        figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_loss(run_dir: Path, records: list[dict[str, Any]], corpus: dict[str, Any] | None) -> None:
    """Training loss (raw and smoothed), validation loss, and the unigram entropy line."""
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in records])
    figure, axis = plt.subplots(figsize=(8, 4.5))
    loss = np.array([r["loss"] for r in records], dtype=float)  # a skipped step's null loss: NaN, a gap
    axis.plot(steps, loss, color="#4C72B0", alpha=0.3, linewidth=1, label="train (per step)")
    axis.plot(steps, _smooth(loss), color="#4C72B0", linewidth=2, label="train (smoothed)")
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if vals:
        axis.plot(*zip(*vals, strict=True), "o-", color="#C44E52", linewidth=2, label="validation")
    if corpus:
        axis.axhline(corpus["unigram_entropy"], color="gray", linestyle="--",
                     label=f"unigram entropy {corpus['unigram_entropy']:.2f}")
    axis.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=f"Loss — {run_dir.name}")
    axis.grid(alpha=0.3)
    axis.legend()
    _save(figure, run_dir / "loss.png")


def _layer_shares(records: list[dict[str, Any]], block: int, experts: int) -> np.ndarray:
    """(experts, steps): each expert's share of block ``block``'s routed tokens at each step (NaN
    at a step without a record of the block)."""
    load = np.full((len(records), experts), np.nan)
    for column, record in enumerate(records):
        counts = next((m["tokens_per_expert"] for m in record.get("moe", []) if m["block"] == block), None)
        if counts is not None:
            load[column] = np.asarray(counts, dtype=float) / max(sum(counts), 1)
    return load.T


def _plot_expert_load(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Per MoE layer, each expert's share of the routed tokens over the steps (a heatmap)."""
    layers = records[-1].get("moe", [])
    if not layers:
        return
    steps = np.array([r["step"] for r in records])
    figure, axes = _layer_grid(len(layers))
    for layer, axis in zip(layers, axes, strict=True):
        share = _layer_shares(records, layer["block"], len(layer["tokens_per_expert"]))
        image = axis.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest",
                            extent=(steps[0] - 0.5, steps[-1] + 0.5, share.shape[0] - 0.5, -0.5),
                            vmin=0, vmax=max(2.0 / share.shape[0], float(np.nanmax(share))))
        axis.set(xlabel="step", ylabel="expert", title=f"block {layer['block']}: share of routed tokens")
        figure.colorbar(image, ax=axis)
    _save(figure, run_dir / "expert_load.png")


def _plot_load_heatmap(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Layers x experts over steps on one scale: a row per MoE layer sharing the step axis, white at
    the uniform share 1/E, red over it, blue under it, so the layers' balance compares at a glance."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    layers = records[-1].get("moe", [])
    if not layers:
        return
    steps = np.array([r["step"] for r in records])
    shares = [_layer_shares(records, m["block"], len(m["tokens_per_expert"])) for m in layers]
    uniform = 1.0 / max(share.shape[0] for share in shares)
    top = max(2 * uniform, *(float(np.nanmax(share)) for share in shares))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=uniform, vmax=top)
    figure, axes = plt.subplots(len(layers), 1, sharex=True, squeeze=False, layout="constrained",
                                figsize=(10, 0.6 + sum(max(1.1, 0.16 * s.shape[0]) for s in shares)))
    for layer, share, axis in zip(layers, shares, axes[:, 0], strict=True):
        image = axis.imshow(share, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest",
                            extent=(steps[0] - 0.5, steps[-1] + 0.5, share.shape[0] - 0.5, -0.5))
        peak = float(np.nanmean(np.nanmax(share, axis=0))) * share.shape[0]
        axis.set_ylabel(f"block {layer['block']}\nexpert", fontsize=8)
        axis.set_title(f"block {layer['block']}: busiest expert {peak:.2f}x its uniform share (mean over steps)",
                       fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("step")
    figure.colorbar(image, ax=axes[:, 0], label=f"share of the layer's tokens (white: {uniform:.3g})")
    _save(figure, run_dir / "load_heatmap.png", tight=False)


def _layer_grid(count: int) -> tuple[Any, list[Any]]:
    """A figure of one panel per MoE layer, two to a row (the load heatmap's layout, so the
    shadowing plot's panels sit where the load panels of the same layers do); spare panels hidden."""
    import matplotlib.pyplot as plt

    columns = min(2, count)
    rows = (count + columns - 1) // columns
    figure, grid = plt.subplots(rows, columns, figsize=(6.5 * columns, 2.6 * rows), squeeze=False)
    axes = [axis for row in grid for axis in row]
    for spare in axes[count:]:
        spare.axis("off")
    return figure, axes[:count]


def _plot_shadowed_experts(run_dir: Path, records: list[dict[str, Any]], shadowed_steps: int) -> None:
    """FasterMoE's Fig. 11: per MoE layer, a mark at (step, expert) for every expert shadowed at
    that step. No plot (and none left from an earlier report) when no step shadowed an expert."""
    path = run_dir / "shadowed_experts.png"
    layers = records[-1].get("moe", [])
    if not layers or not shadowed_steps:
        path.unlink(missing_ok=True)
        return
    steps = (records[0]["step"], records[-1]["step"])
    figure, axes = _layer_grid(len(layers))
    for layer, axis in zip(layers, axes, strict=True):
        marks = [(r["step"], expert) for r in records for m in r.get("moe", [])
                 if m["block"] == layer["block"] for expert in m.get("shadowed", [])]
        if marks:
            axis.scatter(*zip(*marks, strict=True), marker="s", s=12, color="#C44E52")
        experts, shadowing = len(layer["tokens_per_expert"]), len({step for step, _ in marks})
        axis.set(xlabel="step", ylabel="expert", xlim=(steps[0] - 0.5, steps[1] + 0.5), ylim=(experts - 0.5, -0.5),
                 title=f"block {layer['block']}: shadowed experts ({shadowing} of {len(records)} steps)")
        axis.grid(alpha=0.3)
    _save(figure, path)


EXCLUDED_SHADES = {"warm_up": ("#9E9E9E", "warm-up"), "planner_trials": ("#F2C14E", "planner trials")}
"""Shade and legend of each kind of step the time shares leave out."""


def _shade_excluded(axis: Any, excluded: dict[str, list[int]]) -> None:
    """Shade the steps the shares leave out, one legend entry per kind."""
    for kind, steps in excluded.items():
        color, label = EXCLUDED_SHADES[kind]
        for index, (first, last) in enumerate(step_spans(steps)):
            axis.axvspan(first - 0.5, last + 0.5, color=color, alpha=0.3, linewidth=0,
                         label=f"{label} (left out)" if index == 0 else None)


def _plot_time_breakdown(run_dir: Path, records: list[dict[str, Any]], share: dict[str, float],
                         excluded: dict[str, list[int]]) -> None:
    """Time per step by phase (stacked, smoothed over the kept steps: the warm-up and trial steps,
    shaded, are gaps) and each phase's mean share over the kept steps (one bar)."""
    import matplotlib.pyplot as plt

    kept = {r["step"] for r in kept_records(records, excluded)}
    first = next(i for i, r in enumerate(records) if r["step"] in kept)
    steps = np.array([r["step"] for r in records])
    phases = [p for p in PHASE_COLORS if any(r["time_s"].get(p, 0) > 0 for r in records)]
    stacked = np.array([[r["time_s"].get(p, 0.0) * 1e3 if r["step"] in kept else np.nan for r in records]
                        for p in phases])
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    left.stackplot(steps[first:], np.array([_smooth(row)[first:] for row in stacked]),
                   colors=[PHASE_COLORS[p] for p in phases], labels=phases)
    _shade_excluded(left, excluded)
    left.set(xlabel="step", ylabel="ms per step (rank 0, smoothed)", title="Time per step by phase",
             xlim=(steps[0] - 0.5, steps[-1] + 0.5))
    left.grid(alpha=0.3)
    _share_bar(right, phases, share)
    right.set_title(f"Mean share ({len(kept)} of {len(records)} steps)")
    left.legend(loc="upper right", fontsize=8, ncol=2)
    _save(figure, run_dir / "time_breakdown.png")


def _share_bar(axis: Any, phases: list[str], share: dict[str, float]) -> None:
    """One stacked bar of the phases' mean shares, labelled where a share is over 3 %."""
    bottom = 0.0
    for phase in phases:
        axis.bar(0, share[phase] * 100, bottom=bottom, color=PHASE_COLORS[phase], label=phase)
        if share[phase] > 0.03:
            axis.text(0, bottom + share[phase] * 50, f"{phase} {share[phase]:.0%}", ha="center", va="center",
                      fontsize=8, color="white")
        bottom += share[phase] * 100
    axis.set(xticks=[], ylabel="% of step", ylim=(0, 100))


TIMELINE_LANES = {  # lane, color
    "forward": (0, "#D0D8E8"), "backward": (0, "#E8D8D0"), "experts": (0, "#55A868"),
    "alltoall": (1, "#C44E52"), "allreduce": (2, "#4C72B0"),
}


def _plot_timeline(run_dir: Path, timeline: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """One step as lanes of bars: compute (forward and backward spans, expert chunks on them),
    all-to-alls and gradient all-reduces, as Lina draws them."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    figure, axis = plt.subplots(figsize=(12, 3.2))
    for kind, start, stop in timeline["events"]:
        lane, color = TIMELINE_LANES[kind]
        height = 0.8 if kind in ("forward", "backward") else 0.5
        axis.barh(lane, (stop - start) * 1e3, left=start * 1e3, height=height, color=color,
                  edgecolor="black" if kind != "forward" and kind != "backward" else "none", linewidth=0.3)
    comm = next((r.get("comm_s") for r in records if r["step"] == timeline["step"]), None)
    title = f"Step {timeline['step']} on rank 0"
    if comm:
        title += (f": all-to-all {comm['all_to_all_alone'] * 1e3:.1f} ms alone, "
                  f"{comm['all_to_all_with_allreduce'] * 1e3:.1f} ms beside an all-reduce")
    axis.set(yticks=[0, 1, 2], yticklabels=["compute", "all-to-all", "all-reduce"], xlabel="ms from the step's start",
             title=title, ylim=(-0.6, 2.6))
    axis.invert_yaxis()
    axis.grid(axis="x", alpha=0.3)
    axis.legend(handles=[Patch(color=c, label=k) for k, (_, c) in TIMELINE_LANES.items()], fontsize=7, ncol=5,
                loc="lower right")
    _save(figure, run_dir / "timeline.png")
