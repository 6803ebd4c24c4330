"""The compression-rate vs fidelity frontier (Mustafar's Figure 6b as a picture) for ``kvtool eval``
and ``kvtool report``.

Legibility rules: one colour per format (:mod:`kvtool.palette`) in every figure; the papers'
comparison rows are hollow markers, labelled with their comparison label; point labels are placed
where they do not overlap an earlier label (a label that fits nowhere is left out, the point and
its colour stay); on a log y axis, points with no error (the dense format) are left out and named
in a note, so they do not stretch the axis over ten decades.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.core.io import atomic_path
from kvtool.analysis.sweep import METRICS, pareto_front
from kvtool.analysis.palette import format_color

LOG_FLOOR = 1e-6  # below this an error is "none" on a log axis


def plot_frontier(rows: list[dict[str, Any]], path: Path, metric: str, x_key: str = "storage_ratio", title: str = "", ax: Any = None) -> Path | None:
    """Write a PNG/SVG/PDF (by suffix) with one marker series per format: x = % of dense bytes
    (``x_key`` ``storage_ratio`` or ``traffic_ratio``), y = ``metric``; the Pareto front as a line.
    With ``ax`` draw into that matplotlib axis instead and write nothing (returns None).

    rows: flat result rows with ``format``, ``params_text``, ``x_key`` and ``metric`` fields;
    rows with a ``comparison`` are the papers' rows (hollow markers, labelled with ``label``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label, higher = METRICS[metric]
    usable = [r for r in rows if r.get(metric) is not None and r.get(x_key) is not None]
    log_y = metric in ("rel_l2", "kl") and bool(usable)
    omitted = []
    if log_y:
        omitted = [r for r in usable if not r[metric] > LOG_FLOOR]
        usable = [r for r in usable if r[metric] > LOG_FLOOR]
    own_fig = ax is None
    if own_fig:
        fig, ax = plt.subplots(figsize=(8, 5.2))
    else:
        fig = ax.figure
    markers = "osD^v<>ph*X"
    names = sorted({r["format"] for r in usable})
    for n, name in enumerate(names):
        colour = format_color(name)
        mine = [r for r in usable if r["format"] == name]
        sweep = [r for r in mine if not r.get("comparison")]
        paper = [r for r in mine if r.get("comparison")]
        if sweep:
            ax.scatter([100 * r[x_key] for r in sweep], [r[metric] for r in sweep], marker=markers[n % len(markers)], s=44,
                       color=colour, label=name, zorder=3)
        if paper:
            ax.scatter([100 * r[x_key] for r in paper], [r[metric] for r in paper], marker=markers[n % len(markers)], s=52,
                       facecolors="none", edgecolors=colour, linewidths=1.3, label=f"{name} (paper rows)", zorder=3)
    if log_y and usable:
        ax.set_yscale("log")
    front = pareto_front([r[x_key] for r in usable], [r[metric] for r in usable], higher)
    if front:
        ax.plot([100 * usable[i][x_key] for i in front], [usable[i][metric] for i in front], "k--", lw=1, label="Pareto front", zorder=2)
    ax.set_xlabel(f"% of dense bytes ({'stored' if x_key == 'storage_ratio' else 'read per decode step'})")
    ax.set_ylabel(label + (" (higher is better)" if higher else " (lower is better)"))
    ax.grid(True, alpha=0.3)
    note = ""
    if omitted:
        note = f"\nnot drawn (no error on a log axis): {', '.join(sorted({r['format'] for r in omitted}))}"
    ax.set_title((title or "compression vs fidelity") + note, fontsize=9)
    if usable:
        ax.legend(fontsize=7, loc="best", framealpha=0.85)
    if own_fig:
        fig.tight_layout()
    fig.canvas.draw()  # final layout first: labels are placed in pixels
    place_labels(ax, [(100 * r[x_key], r[metric], point_label(r)) for r in usable])
    if not own_fig:
        return None
    fig.tight_layout()
    with atomic_path(path, force=True) as tmp:  # eval's own figure in its folder, redrawn on every run
        fig.savefig(tmp, dpi=130, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def point_label(r: dict[str, Any]) -> str:
    return _short(r["label"]) if r.get("comparison") and r.get("label") else _short(r.get("params_text") or "")


def place_labels(ax: Any, points: list[tuple[float, float, str]], fontsize: float = 6.5) -> int:
    """Annotate points without overlaps: each label tries a few offsets around its point and takes
    the first whose box (estimated from its length) overlaps no earlier label and stays inside the
    axes; labels that fit nowhere are skipped. Returns the number placed."""
    trans = ax.transData
    bbox = ax.get_window_extent()
    char_w, height = fontsize * 0.68 * ax.figure.dpi / 72, fontsize * 1.25 * ax.figure.dpi / 72
    placed: list[tuple[float, float, float, float]] = []
    for x, y, _ in points:  # markers are obstacles too
        px, py = trans.transform((x, y))
        placed.append((px - 5, py - 5, px + 5, py + 5))
    count = 0
    offsets = [(4, 4), (4, -4 - height), (-4, 4), (-4, -4 - height), (4, 12), (-4, 12), (4, -12 - height)]
    for x, y, text in sorted(points, key=lambda p: (p[0], p[1])):
        if not text:
            continue
        px, py = trans.transform((x, y))
        w = char_w * len(text)
        for dx, dy in offsets:
            x0 = px + dx if dx > 0 else px + dx - w
            box = (x0, py + dy, x0 + w, py + dy + height)
            inside = box[0] >= bbox.x0 and box[2] <= bbox.x1 and box[1] >= bbox.y0 and box[3] <= bbox.y1
            if inside and not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                placed.append(box)
                ax.annotate(text, (x, y), xytext=(dx, box[1] - py), textcoords="offset pixels", fontsize=fontsize, alpha=0.85,
                            ha="left" if dx > 0 else "right")
                count += 1
                break
    return count


def _short(params_text: str, limit: int = 28) -> str:
    """A point's label on the plot: its parameters, pipelines as their step values only
    (``evict=snapkv:budget=256,format=quant:bits=4`` -> ``snapkv:budget=256+quant:bits=4``), cut at
    ``limit`` characters (the CSV and JSON keep the full text)."""
    if "evict=" in params_text or "format=" in params_text:
        steps = [part.split("=", 1)[1] for part in params_text.split(",") if "=" in part and part.split("=", 1)[0] in ("evict", "prune", "format")]
        params_text = "+".join(s for s in steps if s != "none")
    return params_text if len(params_text) <= limit else params_text[: limit - 1] + "…"
