"""The Lina Fig. 16-style plot of ``bench lina-inference``: median and p95 batch time of each
schedule over ideal's, one group of bars per model."""

from __future__ import annotations

from typing import Any


def plot_lina_inference(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.bench.lina_inference import SCHEDULES

    rows = [r for r in records if r.get("bench") == "lina-inference"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    width = 0.8 / len(SCHEDULES)
    for axis, (key, title) in zip(axes, (("median_vs_ideal", "median"), ("p95_vs_ideal", "95th percentile")),
                                  strict=True):
        for index, schedule in enumerate(SCHEDULES):
            values = [next((r[key] for r in rows if r["model"] == m and r["schedule"] == schedule), 0.0)
                      for m in models]
            axis.bar([m + index * width for m in range(len(models))], values, width, label=schedule)
        axis.set_xticks([m + 0.4 - width / 2 for m in range(len(models))])
        axis.set_xticklabels([f"{m}\nskew {next(r['skew'] for r in rows if r['model'] == m):.2f}" for m in models])
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(f"{title} batch time")
    axes[0].set_ylabel("time / ideal")
    axes[1].legend(frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
