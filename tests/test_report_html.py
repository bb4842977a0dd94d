"""The run report tells the truth and reads at a glance: bias-corrected smoothing, the warm-up and
the planner's trial steps left out of the time shares, the load heatmap, and ``report.html`` (every
plot inline, the tables, the alerts) as headless Chromium draws it."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moeflow.data import stdlib_directory
from moeflow.parallel.online_planner import DECIDED, UNTIMED
from moeflow.training import TrainConfig
from moeflow.training.launch import run_training
from moeflow.training.metrics import iterate_records
from moeflow.training.report import (
    PHASE_COLORS,
    PLANNER_SEARCH_SOURCES,
    _smooth,
    summarize,
    warmup_steps,
    write_report,
)
from moeflow.training.report_html import REPORT_HTML, step_spans

ALERT = {"kind": "collapse", "block": 1, "step": 3, "message": "block 1 routes <over half> to expert 0"}
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WINDOW = (1200, 3000)

# -- smoothing -----------------------------------------------------------------------------------


def test_smoothing_is_bias_corrected_with_no_first_step_anchor() -> None:
    step = np.array([10.0] + [1.0] * 39)  # a slow first step, then a steady pace
    smoothed = _smooth(step)
    assert smoothed[0] == 10.0  # the first value itself, not a tenth of it
    assert np.all(np.diff(smoothed) < 0) and smoothed[-1] == pytest.approx(1.0, abs=0.02)
    # at step 24 the anchored curve still drew 1 + 9 x 0.9^23 = 1.80; corrected, 9's weight is a tenth of that
    assert smoothed[23] == pytest.approx(1 + 9 * 0.1 * 0.9**23 / (1 - 0.9**24)) and smoothed[23] < 1.1
    assert _smooth(np.full(5, 3.0)) == pytest.approx(np.full(5, 3.0))  # a constant stays itself from the start
    rising = _smooth(np.array([1.0] * 10 + [2.0] * 60))
    assert rising[0] == 1.0 and rising[-1] == pytest.approx(2.0, abs=0.01)


def test_smoothing_carries_over_a_skipped_step() -> None:
    smoothed = _smooth(np.array([float("nan"), 1.0, float("nan"), 2.0]))
    assert np.isnan(smoothed[0]) and list(smoothed[1:3]) == [1.0, 1.0]
    assert smoothed[3] == pytest.approx((0.9 * 0.1 + 0.1 * 2.0) / (1 - 0.9**2))


# -- the steps the shares leave out --------------------------------------------------------------


def _record(step: int, step_s: float, time_s: dict[str, float], source: str = "settled") -> dict[str, Any]:
    """One metrics.jsonl line with what the report reads, for 2 MoE blocks of 4 experts."""
    moe = [{"block": block, "tokens_per_expert": [30 + step, 10, 10 + block, 14], "dropped": 0,
            "schedule": "expert", "pipeline_degree": 1, "alltoall": "linear", "token_exchange": "auto",
            "plan_source": source if block == 1 else "settled"} for block in (0, 1)]
    return {"step": step, "loss": 5.0 - 0.05 * step, "tokens_per_s": 1000.0, "step_s": step_s, "time_s": time_s,
            "moe": moe}


def _records() -> list[dict[str, Any]]:
    """Steps 1-2 slow (the warm-up), 5 and 6 the planner's trials, the others a steady pace of varying phases."""
    records = []
    for step in range(1, 21):
        if step <= 2:
            records.append(_record(step, 3.0 / step, {"routing": 2.5, "attention": 0.1}))
        elif step in (5, 6):
            records.append(_record(step, 0.4, {"all_to_all": 0.3, "experts": 0.1}, "trial" if step == 5 else "warmup"))
        else:
            records.append(_record(step, 0.3, {"attention": 0.1 + 0.01 * step, "experts": 0.2, "routing": 0.02}))
    return records


def test_warm_up_and_trial_steps_are_left_out_of_the_shares() -> None:
    records = _records()
    summary = summarize(records, None)
    assert summary["excluded_steps"] == {"warm_up": [1, 2], "planner_trials": [5, 6]}
    kept = [r["time_s"] for r in records if r["step"] not in (1, 2, 5, 6)]
    mean = {phase: np.mean([t.get(phase, 0.0) for t in kept]) for phase in PHASE_COLORS}
    expected = {phase: value / sum(mean.values()) for phase, value in mean.items()}
    assert summary["time_share"] == pytest.approx(expected)
    assert summary["time_share"]["all_to_all"] == 0.0  # only the trials ran it
    assert summary["median_step_s"] == pytest.approx(0.3)


def test_the_warm_up_is_at_least_step_1_and_ends_when_the_step_time_settles() -> None:
    assert warmup_steps([_record(step, 0.3, {"attention": 0.1}) for step in range(1, 6)]) == [1]
    slow_start = [_record(step, s, {"attention": 0.1}) for step, s in enumerate([2.0, 0.9, 0.44, 0.3, 0.3, 0.3], 1)]
    assert warmup_steps(slow_start) == [1, 2]  # 0.44 is within 1.5 x the median (0.37), 0.9 is not
    assert warmup_steps([{**r, "step_s": None} for r in slow_start]) == [1]  # a run without step times


def test_a_run_of_trial_steps_only_still_has_shares(tmp_path: Path) -> None:
    records = [_record(step, 0.3, {"attention": 0.1, "experts": 0.3}, "trial") for step in range(1, 4)]
    _write_metrics(tmp_path / "run", records)
    summary = write_report(tmp_path / "run")
    assert summary["time_share"]["experts"] == pytest.approx(0.75)
    assert (tmp_path / "run" / "time_breakdown.png").exists()


@pytest.mark.distributed
def test_the_report_knows_every_plan_source(real_run: Path) -> None:
    """The run's steps are either the planner's search (left out) or a decided plan: a source the
    planner gains must be sorted into one or the other here."""
    known = {*PLANNER_SEARCH_SOURCES, *DECIDED, UNTIMED, "model"}
    sources = {layer["plan_source"] for r in iterate_records(real_run) for layer in r["moe"]}
    assert sources <= known and sources & set(PLANNER_SEARCH_SOURCES)
    summary = json.loads((real_run / "summary.json").read_text())
    searching = [r["step"] for r in iterate_records(real_run)
                 if any(layer["plan_source"] in PLANNER_SEARCH_SOURCES for layer in r["moe"])]
    assert summary["excluded_steps"]["planner_trials"] == searching


def test_step_spans() -> None:
    assert step_spans([7, 1, 2, 3, 9, 8, 12]) == [(1, 3), (7, 9), (12, 12)]
    assert step_spans([]) == []


# -- report.html ---------------------------------------------------------------------------------


def _write_metrics(run_dir: Path, records: list[dict[str, Any]]) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, corpus_cache: Path) -> Path:
    """A 10-step run on 2 workers with the online planner searching (its trial steps), one alert added
    to step 3's record, reported by ``moeflow report``."""
    from moeflow.cli import main

    run_dir = tmp_path_factory.mktemp("report") / "run"
    config = TrainConfig(data=str(stdlib_directory() / "json"), vocab_size=512, context=32, layers=2, heads=2,
                         model_dim=32, hidden_dim=64, num_experts=4, top_k=2, batch_size=4, steps=10, eval_interval=5,
                         eval_windows=4, checkpoint_interval=10, warmup_steps=2, progress=False, expert_kernel="bmm",
                         workers=2, run_dir=str(run_dir))
    run_training(config, report=False)
    records = list(iterate_records(run_dir))
    records[2]["alerts"] = [*records[2].get("alerts", []), ALERT]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(run_dir)]) == 0
    return run_dir


class _Page(HTMLParser):
    """The tags, images and visible text of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.images: dict[str, str] = {}
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag == "img":
            found = dict(attrs)
            self.images[found["alt"] or ""] = found["src"] or ""

    def handle_data(self, data: str) -> None:
        self.text.append(data)


@pytest.mark.distributed
def test_report_html_holds_every_plot_inline_the_tables_and_the_alerts(real_run: Path) -> None:
    html = (real_run / REPORT_HTML).read_text()
    page = _Page()
    page.feed(html)
    pngs = {p.name for p in real_run.glob("*.png")}
    assert {"loss.png", "load_heatmap.png", "expert_load.png", "time_breakdown.png", "timeline.png"} <= pngs
    assert set(page.images) == pngs
    prefix = "data:image/png;base64,"
    for name, src in page.images.items():
        assert src.startswith(prefix) and base64.b64decode(src[len(prefix):]) == (real_run / name).read_bytes()
    text = " ".join(page.text)
    for heading in ("Losses", "Speed", "Alerts", "Plots", "Plan choices over time", "Summary", "Settings"):
        assert heading in text
    assert ALERT["message"] in text and "&lt;over half&gt;" in html  # shown, and escaped
    assert "moe_non_gemm_share" in text and "num_experts" in text and "planner_trials" in text
    assert "trial" in text and "settled" in text  # the plan table's sources
    assert not page.tags & {"script", "link", "iframe", "object"}  # nothing to fetch: the file travels alone


def test_the_load_heatmap_has_a_row_per_moe_layer(tmp_path: Path) -> None:
    from matplotlib.image import imread

    two = [_record(step, 0.3, {"attention": 0.1}) for step in range(1, 9)]
    one = [{**r, "moe": r["moe"][:1]} for r in two]
    heights = {}
    for name, records in (("one", one), ("two", two)):
        _write_metrics(tmp_path / name, records)
        write_report(tmp_path / name)
        assert (tmp_path / name / "load_heatmap.png").stat().st_size > 10_000
        heights[name] = imread(tmp_path / name / "load_heatmap.png").shape[0]
    assert heights["two"] > 1.5 * heights["one"]


@pytest.fixture
def browser() -> str:
    """A headless browser's binary; the test skips (before the run it would need) where there is none."""
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        pytest.skip(f"no headless browser on this machine (looked for {', '.join(BROWSERS)})")
    return found


@pytest.mark.distributed
def test_headless_chromium_draws_the_report_with_its_plots(browser: str, real_run: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    f"--window-size={WINDOW[0]},{WINDOW[1]}", (real_run / REPORT_HTML).as_uri()],
                   capture_output=True, timeout=90, check=True)
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    ink = pixels.min(axis=2) < 0.9  # anything not near white: text, lines, plots
    colour = pixels.max(axis=2) - pixels.min(axis=2) > 0.3  # saturated: the plots' colours, never the text
    assert ink.mean() > 0.05 and pixels.std() > 0.1
    assert colour.sum() > 100_000, "the page shows no plot"
    rows_with_colour = np.flatnonzero(colour.sum(axis=1) > 50)
    assert rows_with_colour.max() - rows_with_colour.min() > 1500  # the plots run down the page
