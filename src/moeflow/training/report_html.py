"""``report.html``: a run on one page a person opens from disk (no server, no network): the losses,
the speed, the alerts, every plot of the run folder embedded as a data URI (the file travels alone),
the plans the MoE layers ran over the steps, ``summary.json`` and the run's settings. Standard
library only (:func:`html.escape`, :mod:`base64`): the page is a few tables and images."""

from __future__ import annotations

import base64
import json
from html import escape
from itertools import groupby
from pathlib import Path
from typing import Any

REPORT_HTML = "report.html"
PLOTS = (
    ("loss.png", "Training and validation loss against the corpus's unigram entropy."),
    ("load_heatmap.png", "Load heatmap: each MoE layer's experts over the steps, on one scale (white: uniform)."),
    ("expert_load.png", "Each expert's share of its layer's routed tokens."),
    ("shadowed_experts.png", "The experts FasterMoE shadowed at each step."),
    ("time_breakdown.png", "Time per step by phase; warm-up and planner trial steps shaded and left out of "
                           "the mean shares."),
    ("timeline.png", "One step on rank 0: compute, all-to-alls and gradient all-reduces."),
)
"""The report's plots in reading order, with their captions; any other PNG of the folder follows."""
PLAN_KEYS = ("schedule", "pipeline_degree", "alltoall", "token_exchange", "plan_source")
"""What a MoE layer's record says about the plan it ran."""
MAX_ROWS = 200
"""Rows a long table shows before it says how many it left out."""
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1180px; color: #222; }
h1 { font-size: 22px; margin-bottom: 2px; } h2 { font-size: 17px; margin: 26px 0 8px; }
.cards { display: grid; grid-template-columns: repeat(2, 1fr); gap: 16px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; }
.card h2 { margin-top: 4px; }
table { border-collapse: collapse; font-size: 13px; }
td, th { padding: 2px 8px; text-align: left; vertical-align: top; }
tr:nth-child(even) { background: #f5f5f5; } th { border-bottom: 1px solid #bbb; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 14px 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; } .muted { color: #777; }
.settings { display: grid; grid-template-columns: repeat(3, 1fr); gap: 12px; } .alert { color: #a12622; }
"""


def write_html(run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any]) -> Path:
    """Write ``report.html`` into ``run_dir`` (after the plots: it embeds them); return its path."""
    path = run_dir / REPORT_HTML
    path.write_text(render_page(run_dir, records, summary), encoding="utf-8")
    return path


def render_page(run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The whole page: what a reader wants first (losses, speed, alerts), the plots, then the long tables."""
    title = f"moeflow run {run_dir.name}"
    cards = "".join(_card(name, body) for name, body in (
        ("Losses", _loss_table(records, summary)), ("Speed", _speed_table(summary))))
    body = (f"<h1>{escape(title)}</h1><p class='muted'>{len(records)} steps recorded in metrics.jsonl; "
            f"regenerate with <code>moeflow report {escape(str(run_dir))}</code>.</p>"
            f"<div class='cards'>{cards}</div>"
            f"<h2>Alerts</h2>{_alerts(records)}"
            f"<h2>Plots</h2>{_plots(run_dir)}"
            f"<h2>Plan choices over time</h2>{_plan_table(records)}"
            f"<h2>Summary</h2>{_summary_table(summary)}"
            f"<h2>Settings</h2>{_settings(run_dir)}")
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")


def _card(name: str, body: str) -> str:
    return f"<div class='card'><h2>{escape(name)}</h2>{body}</div>"


def _value(value: Any) -> str:
    """A cell's text: 4 significant digits for a float (thousands whole), a dash for a missing value."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_value(item) for item in value) or "none"
    return str(value)


def _table(rows: list[tuple[Any, ...]], header: tuple[str, ...] = ()) -> str:
    """An HTML table of ``rows`` (every cell escaped; numbers right-aligned), at most :data:`MAX_ROWS`."""
    head = "<tr>" + "".join(f"<th>{escape(name)}</th>" for name in header) + "</tr>" if header else ""
    cells = ["<tr>" + "".join(
        f"<td class='num'>{escape(_value(cell))}</td>" if isinstance(cell, int | float) and not isinstance(cell, bool)
        else f"<td>{escape(_value(cell))}</td>" for cell in row) + "</tr>" for row in rows[:MAX_ROWS]]
    more = f"<p class='muted'>… and {len(rows) - MAX_ROWS} more rows</p>" if len(rows) > MAX_ROWS else ""
    return f"<table>{head}{''.join(cells)}</table>{more}"


def _flatten(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A nested dictionary as (dotted key, value) rows."""
    rows: list[tuple[str, Any]] = []
    for key, value in values.items():
        if isinstance(value, dict):
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def _summary_table(summary: dict[str, Any]) -> str:
    """All of ``summary.json``, its excluded steps as ranges."""
    excluded = {kind: _step_ranges(steps) for kind, steps in summary.get("excluded_steps", {}).items()}
    return _table(_flatten({**summary, "excluded_steps": excluded}))


def _loss_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The first and last training loss, the validation losses and the unigram baseline."""
    rows: list[tuple[Any, ...]] = [
        ("steps", summary["steps"]), ("first loss", records[0].get("loss")), ("last loss", summary["loss"]),
        ("last validation loss", summary["val_loss"]), ("unigram entropy", summary["unigram_entropy"]),
        ("unigram validation loss", summary["unigram_val_loss"]),
    ]
    rows += [(f"validation at step {r['step']}", r["val_loss"]) for r in records if "val_loss" in r]
    return _table(rows)


def _speed_table(summary: dict[str, Any]) -> str:
    """Throughput, the steps the time shares leave out, and each phase's share of a kept step."""
    excluded = summary.get("excluded_steps", {})
    rows: list[tuple[Any, ...]] = [
        ("median tokens/s", summary["median_tokens_per_s"]),
        ("median step (kept steps)", _milliseconds(summary.get("median_step_s"))),
        ("warm-up steps (left out)", _step_ranges(excluded.get("warm_up", []))),
        ("planner trial steps (left out)", _step_ranges(excluded.get("planner_trials", []))),
        ("MoE time outside expert GEMMs", _percent(summary["moe_non_gemm_share"])),
    ]
    rows += [(f"{phase} share", _percent(share)) for phase, share in summary["time_share"].items() if share > 0]
    return _table(rows)


def _percent(share: float | None) -> str:
    return "—" if share is None else f"{share:.1%}"


def _milliseconds(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.4g} ms"


def step_spans(steps: list[int]) -> list[tuple[int, int]]:
    """Steps as runs of consecutive steps, (first, last) each."""
    runs: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if runs and runs[-1][1] == step - 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs


def _step_ranges(steps: list[int]) -> str:
    """Steps as ranges: ``1-3, 7``."""
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in step_spans(steps)) or "none"


def _alerts(records: list[dict[str, Any]]) -> str:
    """Every alert the trainer wrote into a step's record (``alerts``), or a line saying there is none."""
    alerts = [alert for r in records for alert in r.get("alerts", [])]
    if not alerts:
        return "<p class='muted'>No alerts.</p>"
    rows = [(a.get("step"), a.get("block"), a.get("kind"), a.get("message")) for a in alerts]
    return f"<div class='alert'>{_table(rows, ('step', 'block', 'kind', 'message'))}</div>"


def _plan_table(records: list[dict[str, Any]]) -> str:
    """Per MoE block, each run of consecutive steps with one plan: the schedule, pipeline degree,
    all-to-all, token exchange and why it ran (``plan_source``: the planner's trials, settled, ...)."""
    plans = [(layer["block"], r["step"], tuple(layer.get(key) for key in PLAN_KEYS))
             for r in records for layer in r.get("moe", [])]
    rows: list[tuple[Any, ...]] = []
    for block in sorted({block for block, _, _ in plans}):
        steps = [(step, plan) for b, step, plan in plans if b == block]
        for plan, run in groupby(steps, key=lambda item: item[1]):
            numbers = [step for step, _ in run]
            rows.append((block, _step_ranges(numbers), len(numbers), *plan))
    if not rows:
        return "<p class='muted'>No MoE layer recorded a plan.</p>"
    return _table(rows, ("block", "steps", "count", *PLAN_KEYS))


def _plots(run_dir: Path) -> str:
    """Every PNG of the run folder as an image with its bytes inline (:data:`PLOTS` first)."""
    captions = dict(PLOTS)
    names = [name for name, _ in PLOTS if (run_dir / name).exists()]
    names += sorted(p.name for p in run_dir.glob("*.png") if p.name not in captions)
    return "".join(_figure(run_dir / name, captions.get(name, name)) for name in names)


def _figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f"<figure><img src='data:image/png;base64,{data}' alt='{escape(path.name)}'>"
            f"<figcaption>{escape(path.name)}: {escape(caption)}</figcaption></figure>")


def _settings(run_dir: Path, columns: int = 3) -> str:
    """The run's settings from its ``config.json`` (``moeflow train`` writes it) in ``columns`` tables
    side by side, or a line saying why there are none."""
    path = run_dir / "config.json"
    if not path.exists():
        return "<p class='muted'>No config.json in the run folder.</p>"
    rows = _flatten(json.loads(path.read_text()))
    height = -(-len(rows) // columns)
    tables = "".join(f"<div>{_table(rows[start:start + height])}</div>" for start in range(0, len(rows), height))
    return f"<div class='settings'>{tables}</div>"
