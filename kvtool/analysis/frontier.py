"""The compression-rate vs fidelity frontier (Mustafar's Figure 6b as a picture) for ``kvtool eval``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.core.io import atomic_path
from kvtool.analysis.sweep import METRICS, pareto_front


def plot_frontier(rows: list[dict[str, Any]], path: Path, metric: str, x_key: str = "storage_ratio", title: str = "") -> Path:
    """Write a PNG/SVG/PDF (by suffix) with one marker series per format: x = % of dense bytes
    (``x_key`` ``storage_ratio`` or ``traffic_ratio``), y = ``metric``; the Pareto front as a line.

    rows: flat result rows with ``format``, ``params_text``, ``x_key`` and ``metric`` fields."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label, higher = METRICS[metric]
    usable = [r for r in rows if r.get(metric) is not None and r.get(x_key) is not None]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = "osD^v<>ph*X"
    for n, name in enumerate(sorted({r["format"] for r in usable})):
        own = [r for r in usable if r["format"] == name]
        ax.scatter([100 * r[x_key] for r in own], [r[metric] for r in own], marker=markers[n % len(markers)], s=42, label=name, zorder=3)
        for r in own:
            ax.annotate(_short(r["params_text"]), (100 * r[x_key], r[metric]), fontsize=6, xytext=(3, 3), textcoords="offset points", alpha=0.8)
    front = pareto_front([r[x_key] for r in usable], [r[metric] for r in usable], higher)
    if front:
        ax.plot([100 * usable[i][x_key] for i in front], [usable[i][metric] for i in front], "k--", lw=1, label="Pareto front", zorder=2)
    ax.set_xlabel(f"% of dense bytes ({'stored' if x_key == 'storage_ratio' else 'read per decode step'})")
    ax.set_ylabel(label + (" (higher is better)" if higher else " (lower is better)"))
    if metric in ("rel_l2", "kl") and usable and all(r[metric] > 0 for r in usable):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "compression vs fidelity", fontsize=10)
    if usable:
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def _short(params_text: str, limit: int = 28) -> str:
    """A point's label on the plot: its parameters, pipelines as their step values only
    (``evict=snapkv:budget=256,format=quant:bits=4`` -> ``snapkv:budget=256+quant:bits=4``), cut at
    ``limit`` characters (the CSV and JSON keep the full text)."""
    if "evict=" in params_text or "format=" in params_text:
        steps = [part.split("=", 1)[1] for part in params_text.split(",") if "=" in part and part.split("=", 1)[0] in ("evict", "prune", "format")]
        params_text = "+".join(s for s in steps if s != "none")
    return params_text if len(params_text) <= limit else params_text[: limit - 1] + "…"
