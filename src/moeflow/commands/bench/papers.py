"""``moeflow bench papers``: the papers' trends at their scale, simulated.

Its parser and its runner; the benchmark itself is :mod:`moeflow.bench`'s, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from moeflow.commands import add_progress_flag, show_progress


def add(benches: Any) -> None:
    from moeflow.bench.paper_trends import TRENDS

    papers = benches.add_parser(
        "papers", help="the papers' trends simulated on their cluster profiles, beside the published numbers",
        description="Tutel Table 6 and Fig. 14, PipeMoE Table VI, FasterMoE Fig. 13, Lina's all-to-all under "
        "contention: one JSON line per cell (simulated, published, their ratio) and a summary per table.",
    )
    papers.add_argument("--only", nargs="+", choices=sorted(TRENDS), default=None,
                        help="simulate only these tables (default all)")
    papers.add_argument("--plot", default=None, metavar="FOLDER", help="write one bar chart per table into this folder")
    add_progress_flag(papers)
    papers.set_defaults(func=run_papers)


def run_papers(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moeflow.bench.paper_trends import TRENDS, plot, summarize
    from moeflow.files import print_json
    from moeflow.progress import progress_bar

    rows, names = [], args.only or list(TRENDS)
    with progress_bar("bench papers", "table", len(names), enabled=show_progress(args)) as progress:
        for name in names:
            progress.note(name)
            for row in TRENDS[name]():
                print_json(row)
                rows.append(row)
            progress.advance()
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)
        for path in plot(rows, Path(args.plot)):
            print_json({"plot": str(path)})
    print_json(summarize(rows))
    return 0
