"""The compression-rate vs fidelity frontier (Mustafar's Figure 6b as a picture) for ``kvtool eval``
and ``kvtool report``.

Legibility rules: one colour per format (:mod:`kvtool.palette`) in every figure; the papers'
comparison rows are hollow markers, labelled with their comparison label; point labels are placed
where they do not overlap an earlier label (a label that fits nowhere is left out, the point and
its colour stay); on a log y axis, points with no error (the dense format) are left out and named
in a note, so they do not stretch the axis over ten decades.
"""

from __future__ import annotations

import math
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
        readable_log_axis(ax)
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


def readable_log_axis(ax: Any) -> None:
    """A log y axis with ticks at 1, 2 and 5 of every decade, written as plain numbers (0.05, 0.1,
    0.2), so that a range of one decade still has several labelled ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _box_distance(box: tuple[float, float, float, float], px: float, py: float) -> float:
    """Pixels from point (px, py) to the box (0 inside it)."""
    dx = max(box[0] - px, 0.0, px - box[2])
    dy = max(box[1] - py, 0.0, py - box[3])
    return math.hypot(dx, dy)


# candidate places around a point, nearest first: (dx, dy) in pixels from the point to the label's
# anchor, and how the label hangs from it
_OFFSETS = [(r * dx, r * dy, ha, va) for r in (4, 9, 16)
            for dx, dy, ha, va in ((1, 1, "left", "bottom"), (1, -1, "left", "top"), (-1, 1, "right", "bottom"), (-1, -1, "right", "top"),
                                   (1, 0, "left", "center"), (-1, 0, "right", "center"), (0, 1.5, "center", "bottom"), (0, -1.5, "center", "top"))]


# farther places for a label that must be drawn: a ring of directions at growing radii, joined to its
# point by a leader line
_FAR = [(r * math.cos(a), r * math.sin(a)) for r in (26, 40, 56, 76) for a in [k * math.pi / 8 for k in range(16)]]


def place_labels(ax: Any, points: list[tuple[float, float, str]], fontsize: float = 6.5, leader: bool = False) -> int:
    """Annotate points so that no label can be read as another point's: each label tries places
    around its point, nearest first, and takes the first whose drawn box stays inside the axes,
    overlaps no marker or earlier label, and is nearer its own point than any other point. Points
    drawn on the same spot share one label (``a / b``). A label that fits nowhere is left out (the
    point and its colour stay), unless ``leader``: then it goes farther out, joined to its point by a
    thin line, where it overlaps no marker or label (else where it overlaps no label, else at the
    first place inside the axes), so every point is labelled. Returns the number of labels placed."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    trans = ax.transData
    bbox = ax.get_window_extent(renderer)
    pix = [tuple(trans.transform((x, y))) for x, y, _ in points]
    groups: dict[tuple[int, int], list[int]] = {}
    for n, (px, py) in enumerate(pix):
        groups.setdefault((round(px), round(py)), []).append(n)
    spots = [(pix[g[0]], points[g[0]][:2], " / ".join(dict.fromkeys(points[n][2] for n in g if points[n][2]))) for g in groups.values()]
    obstacles = [(px - 5, py - 5, px + 5, py + 5) for (px, py), _, _ in spots]
    count = 0
    for (px, py), (x, y), text in sorted(spots, key=lambda s: (s[1][0], s[1][1])):
        if not text:
            continue
        others = [(ox, oy) for (ox, oy), _, _ in spots if (ox, oy) != (px, py)]
        for dx, dy, ha, va in _OFFSETS:
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset pixels", fontsize=fontsize, alpha=0.9, ha=ha, va=va)
            ext = ann.get_window_extent(renderer)
            box = (ext.x0, ext.y0, ext.x1, ext.y1)
            own = _box_distance(box, px, py)
            ok = (box[0] >= bbox.x0 and box[2] <= bbox.x1 and box[1] >= bbox.y0 and box[3] <= bbox.y1
                  and not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3]
                              for b in obstacles if b != (px - 5, py - 5, px + 5, py + 5))
                  and all(own + 1.0 < _box_distance(box, ox, oy) for ox, oy in others))
            if ok:
                obstacles.append(box)
                count += 1
                break
            ann.remove()
        else:
            if leader and _place_far(ax, renderer, bbox, (x, y), (px, py), text, fontsize, obstacles):
                count += 1
    return count


def _place_far(ax: Any, renderer: Any, bbox: Any, xy: tuple[float, float], pix: tuple[float, float], text: str, fontsize: float,
               obstacles: list[tuple[float, float, float, float]]) -> bool:
    """Place ``text`` on a ring around its point with a leader line (:func:`place_labels`)."""
    from matplotlib.text import Text

    def overlaps(box, boxes):
        return any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes)

    markers = [b for b in obstacles if b[2] - b[0] == 10 and b[3] - b[1] == 10]
    labels = [b for b in obstacles if b not in markers]
    fallback = []
    for dx, dy in _FAR:
        ann = ax.annotate(text, xy, xytext=(dx, dy), textcoords="offset pixels", fontsize=fontsize, alpha=0.9,
                          ha="left" if dx > 1 else "right" if dx < -1 else "center", va="bottom" if dy > 1 else "top" if dy < -1 else "center",
                          arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.45", "shrinkA": 1, "shrinkB": 3})
        ext = Text.get_window_extent(ann, renderer)  # the text's box, without its leader line
        box = (ext.x0, ext.y0, ext.x1, ext.y1)
        inside = box[0] >= bbox.x0 and box[2] <= bbox.x1 and box[1] >= bbox.y0 and box[3] <= bbox.y1
        own_marker = (pix[0] - 5, pix[1] - 5, pix[0] + 5, pix[1] + 5)
        if inside and not overlaps(box, labels) and not overlaps(box, [m for m in markers if m != own_marker]):
            obstacles.append(box)
            return True
        if inside:
            fallback.append(((overlaps(box, labels), dx, dy), box))
        ann.remove()
    if not fallback:
        return False
    (_, dx, dy), box = min(fallback, key=lambda f: f[0][0])
    ax.annotate(text, xy, xytext=(dx, dy), textcoords="offset pixels", fontsize=fontsize, alpha=0.9,
                ha="left" if dx > 1 else "right" if dx < -1 else "center", va="bottom" if dy > 1 else "top" if dy < -1 else "center",
                arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.45", "shrinkA": 1, "shrinkB": 3})
    obstacles.append(box)
    return True


def _short(params_text: str, limit: int = 28) -> str:
    """A point's label on the plot: its parameters, pipelines as their step values only
    (``evict=snapkv:budget=256,format=quant:bits=4`` -> ``snapkv:budget=256+quant:bits=4``), cut at
    ``limit`` characters (the CSV and JSON keep the full text)."""
    if "evict=" in params_text or "format=" in params_text:
        steps = [part.split("=", 1)[1] for part in params_text.split(",") if "=" in part and part.split("=", 1)[0] in ("evict", "prune", "format")]
        params_text = "+".join(s for s in steps if s != "none")
    return params_text if len(params_text) <= limit else params_text[: limit - 1] + "…"
