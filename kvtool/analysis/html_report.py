"""``kvtool report``: one self-contained HTML file that answers "what should I use at my budget, and
what does it cost?" for a capture.

Sections (each with figures inlined as base64 PNG and a short generated reading):

- ``model``: the capture's model facts and the dense KV bytes per token;
- ``cut``: where the cache can be cut: outlier channels (keys/values), attention concentration
  (keys needed for 90% of the mass) and head importance (heads needed for 90% of the output norm),
  per layer, with the outlier map and one layer's concentration and head-importance pictures;
- ``frontier``: every candidate setting of every format as a uniform setting (attention level, the
  recommend sensitivity) with the recommended plans, and the model-level cost of the settings that
  were checked on the model; the ``kvtool eval`` frontier when ``--eval DIR`` is given;
- ``recommend``: the plan per budget (default 10/15/25/40%), what it holds, and its model-level cost
  (capture continuation and mean with 95% interval over the held-out texts) beside the best uniform;
- ``kernels``: kernel timings against cuBLAS / FlashInfer from ``kvtool bench --json`` files.

No network: no scripts, fonts or images from elsewhere. One colour per format in every figure
(:mod:`kvtool.analysis.palette`).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io as _io
import json
import math
from pathlib import Path
from typing import Any

from kvtool.core.documents import check_eval_points, read_bench_document
from kvtool.analysis.taskfiles import check_summary
from kvtool.core.errors import UsageError
from kvtool.core.limits import read_json_input
from kvtool.core.names import upgrade_keys
from kvtool.analysis.palette import format_color, spec_format
from kvtool.analysis.bands import grade
from kvtool.analysis.frontier import place_labels, readable_log_axis
from kvtool.analysis.stats import (
    StatsSettings,
attention_summary,
channel_mean_abs,
head_rows,
layer_attention,
outlier_channels,
outlier_ratios,
token_mask,
)
from kvtool.core import io
from kvtool.core.progress import Progress, or_silent
from kvtool.analysis.recommendation import recommend_capture
from kvtool.analysis.plots import concentration_figure, head_importance_figure, outlier_map_figure
from kvtool.analysis.frontier import plot_frontier
from kvtool.analysis import answer as answering

SECTIONS = ("answer", "model", "cut", "frontier", "recommend", "tasks", "kernels")
DEFAULT_BUDGETS = ("10%", "15%", "25%", "40%")


# ----------------------------------------------------------------------------- figures


def fig_png(fig: Any) -> str:
    """A matplotlib figure as a base64 PNG string. Every figure here is made without pyplot (an Agg
    canvas of its own), so nothing keeps it alive once the caller drops it."""
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(w: float = 8.0, h: float = 4.6, nrows: int = 1, ncols: int = 1, **kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=True, **kw)


def cut_map_figure(per_layer: list[dict[str, Any]]) -> Any:
    """Per layer: share of visible keys needed for 90% of the attention mass, share of query heads
    needed for 90% of the output norm, and the number of outlier key / value channels."""
    fig, (a1, a2) = _figure(8.5, 4.6, 2, 1, sharex=True)
    layers = [r["layer"] for r in per_layer]
    a1.plot(layers, [100 * r["keys90_frac"] for r in per_layer], marker="o", ms=3, color="#0072B2", label="keys for 90% of attention mass")
    a1.plot(layers, [100 * r["heads90_frac"] for r in per_layer], marker="s", ms=3, color="#D55E00", label="query heads for 90% of output norm")
    a1.set_ylabel("% needed")
    a1.set_ylim(0, 105)
    a1.grid(True, alpha=0.3)
    a1.legend(fontsize=7, loc="center right")
    a1.set_title("what attention needs, per layer (lower: more can be cut)", fontsize=9)
    width = 0.4
    a2.bar([l - width / 2 for l in layers], [r["k_outliers"] for r in per_layer], width, color="#009E73", label="key channels")
    a2.bar([l + width / 2 for l in layers], [r["v_outliers"] for r in per_layer], width, color="#CC79A7", label="value channels")
    a2.set_ylabel("outlier channels\n(all KV heads)")
    a2.set_xlabel("layer")
    a2.grid(True, axis="y", alpha=0.3)
    a2.legend(fontsize=7)
    return fig


def region_points(uniform: list[dict[str, Any]], region: float | None) -> list[dict[str, Any]]:
    """The uniform settings drawn in the decision region (stored share at most ``region``), numbered
    1.. by stored share then error: the numbers the frontier figure writes beside their dots and its
    table lists. Settings with no error (dense) are not drawn, so not numbered."""
    if region is None:
        return []
    rows = sorted((r for r in uniform if r["loss"] > 1e-10 and r["storage_ratio"] <= region), key=lambda r: (r["storage_ratio"], r["loss"]))
    return [{**r, "number": n + 1} for n, r in enumerate(rows)]


def attention_frontier_figure(uniform: list[dict[str, Any]], plans: list[dict[str, Any]], n_layers: int, region: float | None = None) -> Any:
    """x: % of dense bytes; y: RMS over layers of the attention-output relative error (weighted by the
    layers' model cost when weights were measured), log scale; every candidate as a uniform setting
    (one colour per format), the plans as red stars. Settings with no error (dense) are left out.
    ``region``: the decision region (stored shares up to the largest budget, shaded): every dot there
    is labelled with its number from :func:`region_points` (a leader line where it cannot sit beside
    its dot), the dots beyond it with their spec where that fits."""
    fig, ax = _figure(8.5, 5.0)
    rows = [r for r in uniform if r["loss"] > 1e-10]
    for fmt in sorted({spec_format(r["spec"]) for r in rows}):
        mine = [r for r in rows if spec_format(r["spec"]) == fmt]
        ax.scatter([100 * r["storage_ratio"] for r in mine], [math.sqrt(r["loss"] / n_layers) for r in mine], color=format_color(fmt), s=36, label=fmt, zorder=3)
    if plans:
        ax.scatter([100 * p["storage_ratio"] for p in plans], [math.sqrt(p["loss"] / n_layers) for p in plans], marker="*", s=190,
                   color=format_color("mixed"), edgecolors="black", linewidths=0.6, label="recommended plan", zorder=4)
    if region is not None:
        ax.axvspan(0, 100 * region, color="#0072B2", alpha=0.05, zorder=1, label="decision region (numbered)")
    ax.set_yscale("log")
    readable_log_axis(ax)
    ax.set_xlabel("% of dense bytes (stored)")
    ax.set_ylabel("attention-output error\n(RMS over layers, lower is better)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.canvas.draw()  # final layout first: labels are placed in pixels
    numbered = region_points(uniform, region)
    plan_labels = [(100 * p["storage_ratio"], math.sqrt(p["loss"] / n_layers), f"plan @ {p['budget']}") for p in plans]
    place_labels(ax, plan_labels + [(100 * r["storage_ratio"], math.sqrt(r["loss"] / n_layers), str(r["number"])) for r in numbered], fontsize=7, leader=True)
    ids = {id(r) for r in rows if region is not None and r["storage_ratio"] <= region}
    place_labels(ax, [(100 * r["storage_ratio"], math.sqrt(r["loss"] / n_layers), _short_spec(r["spec"])) for r in rows if id(r) not in ids])
    return fig


def region_table(numbered: list[dict[str, Any]], rec: dict[str, Any], n_layers: int) -> str:
    """The numbered dots of the frontier's decision region: number, setting, stored share, error,
    and the budgets whose best uniform setting it is."""
    if not numbered:
        return ""
    best: dict[str, list[str]] = {}
    for b in rec["budgets"]:
        u = answering.best_uniform(b)
        if u:
            best.setdefault(u["spec"], []).append(b["budget"])
    marked = any(r["spec"] in best for r in numbered)
    body = "".join(f'<tr><td>{r["number"]}</td><td class="spec" title="{html.escape(r["spec"])}">{html.escape(answering.uniform_words(r["spec"]))}</td>'
                   f'<td>{pct(r["storage_ratio"])}</td><td>{math.sqrt(r["loss"] / n_layers):.3g}</td>'
                   + (f'<td>{html.escape(", ".join(best.get(r["spec"], [])))}</td>' if marked else "") + "</tr>" for r in numbered)
    head = "<tr><th>#</th><th>uniform setting</th><th>stored</th><th>error</th>" + ("<th>best uniform at</th>" if marked else "") + "</tr>"
    return f'<table class="numbered">{head}{body}</table>'



def model_cost_figure(budgets: list[dict[str, Any]]) -> Any:
    """NLL increase (nats/token) vs % of dense bytes (on the capture) of every setting checked on the
    model: the marker is the mean over all cases and the bar its 95% interval, both from the same
    numbers (settings checked on the capture alone: its value, no bar). Symmetric-log y axis, linear
    within +-0.01 nats (the noise band, shaded)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullLocator

    fig, ax = _figure(8.5, 4.8)
    seen: set[str] = set()
    pts, ys, fmts = [], [], set()
    for b in budgets:
        for label, sc in (b.get("check") or {}).items():
            is_plan = label == b.get("plan_label")
            key = label if not is_plan else f"plan{b['budget']}"
            if key in seen:
                continue
            seen.add(key)
            c0 = sc["cases"][0]
            iv = sc["nll_increase"]
            x, y = 100 * answering.field(c0, "storage_ratio"), iv["mean"]
            fmt = "mixed" if is_plan else spec_format(label)
            fmts.add(fmt)
            colour = format_color(fmt)
            ys.append(y)
            if iv["n"] > 1:
                ax.errorbar([x], [y], yerr=[[iv["mean"] - iv["lo"]], [iv["hi"] - iv["mean"]]],
                            fmt="none", ecolor=colour, alpha=0.5, capsize=3, zorder=2)
                ys += [iv["lo"], iv["hi"]]
            ax.scatter([x], [y], marker="*" if is_plan else "o", s=170 if is_plan else 40, color=colour,
                       edgecolors="black" if is_plan else "none", linewidths=0.6, zorder=3)
            pts.append((x, y, f"plan @ {b['budget']}" if is_plan else f"best uniform @ {b['budget']}" if label == b.get("best_uniform") else _short_spec(label)))
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("% of dense bytes (stored)")
    n_cases = max((len(sc["cases"]) for b in budgets for sc in (b.get("check") or {}).values()), default=1)
    ax.set_ylabel("NLL increase over dense (nats/token)\n" + (f"(marker: mean of {n_cases} cases; bar: its 95% interval)" if n_cases > 1 else "(the capture's continuation)"))
    ax.set_yscale("symlog", linthresh=0.01)
    if ys:
        lo, hi = min(ys + [0.0]), max(ys + [0.0])
        ax.set_ylim(lo - 0.3 * max(0.01, abs(lo)), hi + 0.3 * max(0.01, abs(hi)))
    lo, hi = ax.get_ylim()  # 1-2-5 ticks (from 0.002 up, nearer 0 they crowd the linear band) and 0
    steps = [sign * k * 10.0**e for sign in (1, -1) for e in range(-3, 3) for k in (1, 2, 5)]
    ax.set_yticks(sorted([0.0] + [t for t in steps if abs(t) >= 0.002 and lo <= t <= hi]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:+g}" if v else "0"))
    ax.axhspan(-0.01, 0.01, color="grey", alpha=0.08, zorder=1)  # within +-0.01: noise (docs/fidelity.md)
    ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], marker="*", color=format_color("mixed"), markeredgecolor="black", markersize=11, ls="", label="recommended plan")]
    handles += [Line2D([], [], marker="o", color=format_color(f), ls="", label=f"uniform {f}") for f in sorted(fmts - {"mixed"})]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.canvas.draw()  # final layout first: labels are placed in pixels
    place_labels(ax, pts)
    return fig


def plan_mix_figure(budgets: list[dict[str, Any]], num_kv_heads: int) -> Any:
    """Stacked bars: what share of the KV heads each format holds in each budget's plan."""
    fig, ax = _figure(8.5, 3.4)
    fmts = sorted({spec_format(s) for b in budgets for specs in b["plan"].layers.values() for s in specs})
    labels = [b["budget"] for b in budgets]
    bottom = [0.0] * len(budgets)
    for fmt in fmts:
        shares = []
        for b in budgets:
            total = n = 0
            for specs in b["plan"].layers.values():
                heads = specs * (num_kv_heads if len(specs) == 1 else 1)
                total += len(heads)
                n += sum(1 for s in heads if spec_format(s) == fmt)
            shares.append(100 * n / total if total else 0)
        ax.barh(labels, shares, left=bottom, color=format_color(fmt), label=fmt)
        bottom = [a + s for a, s in zip(bottom, shares)]
    ax.set_xlabel("% of KV heads (all layers)")
    ax.set_ylabel("budget")
    ax.set_xlim(0, 100)
    ax.legend(fontsize=7, ncols=min(4, len(fmts)), loc="upper center", bbox_to_anchor=(0.5, -0.28))
    return fig


def bench_figure(records: list[dict[str, Any]]) -> Any:
    """Median µs per case (batch x tokens) by series (provider, and sparsity for sparse kernels),
    grouped bars, log y; kvtool's kernels in reds, baselines in blues/greys."""
    def series(r: dict[str, Any]) -> str:
        return r["provider"] + (f" {r['sparsity']:.0%}" if r.get("sparsity") is not None else "")

    cases = sorted({(r.get("batch") or 0, r.get("seq") or 0) for r in records})
    names = sorted({series(r) for r in records}, key=lambda n: (not n.split()[0].endswith("_triton"), n))
    fig, ax = _figure(9.0, 4.6)
    width = 0.84 / max(1, len(names))
    ours = ["#C00000", "#E06666", "#F4A6A6", "#8B0000"]
    base = ["#0072B2", "#56B4E9", "#009E73", "#E69F00", "#CC79A7", "#999999", "#7F3C8D"]
    n_ours = n_base = 0
    for j, name in enumerate(names):
        if name.split()[0].endswith("_triton"):
            colour, n_ours = ours[n_ours % len(ours)], n_ours + 1
        else:
            colour, n_base = base[n_base % len(base)], n_base + 1
        ys = []
        for case in cases:
            rec = [r for r in records if series(r) == name and (r.get("batch") or 0, r.get("seq") or 0) == case]
            ys.append(rec[0]["median_us"] if rec else 0)
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=name, color=colour)
    ax.set_xticks([i + 0.42 - width / 2 for i in range(len(cases))], [f"batch {b}, {t // 1024}k tokens" for b, t in cases], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median µs per decode step (lower is better)")
    ax.grid(True, axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _short_spec(spec: str, limit: int = 30) -> str:
    s = spec.replace(",group=128,residual=0", ",g128").replace("+quant:bits=4,g128", "+q4").replace("snapstream:", "snap:")
    return s if len(s) <= limit else s[: limit - 1] + "…"


# ----------------------------------------------------------------------------- data


def cut_summary(cache: Any, max_queries: int = 32) -> dict[str, Any]:
    """Per layer: keys needed for 90% of the attention mass and heads for 90% of the output norm
    (shares), outlier channels of keys/values; and the outlier ratios for the outlier map."""
    settings = StatsSettings(max_queries=max_queries)
    mask = token_mask(cache)
    per_layer, ratios, atts = [], {"keys": {}, "values": {}}, {}
    for i in cache.layer_indices:
        layer = cache.layers[i]
        row: dict[str, Any] = {"layer": i}
        for part, tag in (("keys", "k"), ("values", "v")):
            rows = head_rows(getattr(layer, part), mask)
            n = 0
            for h in range(rows.shape[0]):
                means = channel_mean_abs(rows[h])
                ratios[part][(i, h)] = outlier_ratios(means)
                n += len(outlier_channels(means, settings.outlier_factor))
            row[f"{tag}_outliers"] = n
        if cache.has_queries:
            att = layer_attention(layer, cache.facts, settings, cache.attention_mask)
            atts[i] = att
            summ = attention_summary(att, settings)["all_heads"]
            row["keys90_frac"], row["heads90_frac"] = summ["keys90_frac"], summ["heads90_frac"]
        per_layer.append(row)
    return {"layers": per_layer, "ratios": ratios, "attention": atts, "factor": settings.outlier_factor}


def read_eval_of(folder: Path, capture: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The points of ``FOLDER/eval.json`` made on ``capture`` (the same file, or one of the same
    name), and the names of the other captures whose points were left out."""
    rows = read_eval(folder)
    mine = [r for r in rows if _same_capture(r.get("capture"), capture)]
    others = sorted({Path(str(r.get("capture", "?"))).name for r in rows if r not in mine})
    return mine, others


def _same_capture(path: Any, capture: Path) -> bool:
    if not path:
        return False
    p = Path(str(path))
    try:
        if p.exists() and capture.exists():
            return p.resolve() == capture.resolve() or p.samefile(capture)
    except OSError:  # an unreadable path: fall back to the names
        return p.name == capture.name
    return p.name == capture.name


def read_eval(folder: Path) -> list[dict[str, Any]]:
    """The points of ``FOLDER/eval.json`` that were run (checked: :mod:`kvtool.core.documents`)."""
    path = Path(folder) / "eval.json"
    if not path.exists():
        raise UsageError(f"--eval {folder}: no eval.json there (run kvtool eval CAPTURE -o {folder} first)")
    points = check_eval_points(read_json_input(path, f"--eval {path}"), f"--eval {path}")
    return [p for p in points if not p.get("skipped")]


def read_tasks(folder: Path) -> dict[str, Any]:
    """The summary a ``kvtool tasks`` run wrote (``tasks.json``)."""
    path = Path(folder) / "tasks.json"
    if not path.is_file():
        raise UsageError(f"--tasks {folder}: no tasks.json there (run kvtool tasks --out-dir {folder} first)")
    # a summary of an earlier kvtool: old key names read under the current ones, then every field checked
    return check_summary(upgrade_keys(read_json_input(path, f"--tasks {path}"), f"--tasks {path}"), f"--tasks {path}")


def reading_tasks(summary: dict[str, Any]) -> str:
    rows = [r for r in summary["by_setting"] if r.get("accuracy") is not None]
    dense = next((r for r in rows if r["setting"] == "dense"), None)
    others = sorted((r for r in rows if r["setting"] != "dense"), key=lambda r: -r["accuracy"])
    tasks = ", ".join(f"{t['task']} {t['length']}" for t in summary.get("tasks", []))
    text = f"Accuracy on {tasks}, the question asked after the context was compressed."
    if dense is not None:
        text += f" The dense model answers {100 * dense['accuracy']:.0f}% (n={dense['n']})."
    if others:
        best = others[0]
        text += f" Best compressed setting: {best['setting']} at {100 * best['storage_ratio']:.1f}% of the float16 bytes, {100 * best['accuracy']:.0f}% [{100 * best['lo']:.0f}, {100 * best['hi']:.0f}]."
    return text


def tasks_section(summary: dict[str, Any]) -> tuple[str, int]:
    """The tasks section's body (frontier figure and table) and its figure count."""
    points = [{"format": r["method"], "params_text": "" if r["budget"] is None else f"{100 * r['budget']:g}%",
               "storage_ratio": r["storage_ratio"], "task_accuracy": r["accuracy"]} for r in summary["by_setting"] if r.get("accuracy") is not None]
    body, figures = "", 0
    if points:
        fig, ax = _figure(8.5, 5.2)
        plot_frontier(points, Path("unused.png"), "task_accuracy", title="task accuracy, mean over the tasks", ax=ax)
        body += _img(fig_png(fig), "task accuracy frontier")
        figures += 1
    tasks = [(t["task"], t["length"]) for t in summary.get("tasks", [])]
    cells = {(c["setting"], c["task"], c["length"]): c for c in summary["cells"]}
    rows = []
    for r in sorted(summary["by_setting"], key=lambda r: (r["budget"] or 0, -(r["accuracy"] or 0))):
        row = [r["setting"], pct(r["storage_ratio"])]
        for t, n in tasks:
            c = cells.get((r["setting"], t, n))
            row.append("-" if c is None or not c["n"] else f"{100 * c['accuracy']:.0f}% [{100 * c['lo']:.0f}, {100 * c['hi']:.0f}]")
        rows.append(row)
    body += _table(["setting", "stored"] + [f"{t} {n}" for t, n in tasks], rows)
    return body, figures


def read_bench(paths: list[Path]) -> list[dict[str, Any]]:
    """The ``--bench`` documents, each checked field by field (:mod:`kvtool.core.documents`)."""
    docs = []
    for p in paths:
        doc = read_bench_document(p, f"--bench {p}", tables=False)
        doc["_path"] = str(p)
        docs.append(doc)
    return docs


# ----------------------------------------------------------------------------- readings


def pct(v: float | None, signed: bool = False, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{100 * v:+.{digits}f}%" if signed else f"{100 * v:.{digits}f}%"


def reading_cut(cut: dict[str, Any]) -> str:
    rows = cut["layers"]
    k_out = sum(r["k_outliers"] for r in rows)
    v_out = sum(r["v_outliers"] for r in rows)
    text = [f"{k_out} key channels and {v_out} value channels (over all {len(rows)} layers and their KV heads) are outliers "
            f"(mean |x| at least {cut['factor']:g}x the median channel): {'keys need per-channel care (KIVI quantises keys per channel for this reason)' if k_out > 2 * max(1, v_out) else 'keys and values are similarly spread'}."]
    with_att = [r for r in rows if "keys90_frac" in r]
    if with_att:
        sharp = min(with_att, key=lambda r: r["keys90_frac"])
        flat = max(with_att, key=lambda r: r["keys90_frac"])
        mean = sum(r["keys90_frac"] for r in with_att) / len(with_att)
        heads = sum(r["heads90_frac"] for r in with_att) / len(with_att)
        text.append(f"On average a query needs {pct(mean, digits=0)} of the keys it sees for 90% of its attention mass, from "
                    f"{pct(sharp['keys90_frac'], digits=0)} in layer {sharp['layer']} (eviction and page selection are safest there) to "
                    f"{pct(flat['keys90_frac'], digits=0)} in layer {flat['layer']} (keep that layer's tokens; quantise instead).")
        text.append(f"{pct(heads, digits=0)} of the query heads carry 90% of the output norm on average: "
                    + ("few heads matter per query, so head selection has room." if heads < 0.6 else "most heads matter, so head selection saves little."))
    return " ".join(text)


def reading_frontier(rec: dict[str, Any]) -> str:
    uni = [r for r in rec["sensitivity"]["uniform"] if r["loss"] > 0]
    n = len(rec["menu"])
    text = [f"{n} candidate settings were scored on every layer's held-out queries."]
    by_spec = {r["spec"]: r for r in uni}
    for b in rec["budgets"]:
        best = answering.best_uniform(b)
        if best is None:
            continue
        row = by_spec.get(best["spec"])
        if row is not None and b["predicted"]["loss"] > 0:
            text.append(f"At {b['budget']}, the plan's predicted attention loss is {row['loss'] / b['predicted']['loss']:.1f}x lower than "
                        f"the best uniform setting ({best['spec']}, {pct(best['ratio'])} stored).")
        else:
            text.append(f"At {b['budget']}, the best uniform setting is {best['spec']} ({pct(best['ratio'])} stored; {best['how']}).")
    return " ".join(text)


def reading_budget(b: dict[str, Any], cases: list[str]) -> str:
    check = b.get("check")
    if not check:
        best = answering.best_uniform(b)
        return (f"At {b['budget']} of the bytes the plan stores {pct(b['predicted']['exact_storage_ratio'])}; it was not checked on the model "
                "(no model for this capture, or --no-model)" + (f"; the best uniform setting by predicted attention error is {best['spec']} "
                                                                  f"({pct(best['ratio'])})." if best else "."))
    plan = check[b["plan_label"]]
    p0 = plan["cases"][0]
    text = (f"At {b['budget']} of the bytes, the plan ({pct(p0['storage_ratio'])} stored) keeps {p0['agreement']:.0%} top-1 agreement "
            f"({grade('agreement', p0['agreement'])}) with an NLL increase of {nll_text(p0['nll_increase'])} on the capture's continuation")
    if plan["agreement"]["n"] > 1:
        a, r = plan["agreement"], plan["nll_increase"]
        text += (f" ({a['mean']:.0%} [{a['lo']:.0%}, {a['hi']:.0%}] and {nll_text(r['mean'])} [{r['lo']:+.4f}, {r['hi']:+.4f}] "
                 f"over {a['n']} cases)")
    best = b.get("best_uniform")
    if best and best in check:
        u0 = check[best]["cases"][0]
        text += (f"; the best uniform setting, {best} ({pct(answering.field(u0, 'storage_ratio'))}), keeps {u0['agreement']:.0%} with "
                 f"{nll_text(u0['nll_increase'])}.")
    else:
        text += "; no uniform setting fits this budget."
    return text


def reading_decode(doc: dict[str, Any]) -> str:
    """A ``kvtool bench decode`` document in one line: each setting's decode tokens/s against dense of
    the same batch and context, on the document's card and model shape."""
    recs = answering.decode_records([doc])
    dense = {(r.get("batch"), r.get("seq")): r for r in recs if str(answering.field(r, "provider")).startswith("dense")}
    parts = []
    for r in recs:
        d = dense.get((r.get("batch"), r.get("seq")))
        name = str(answering.field(r, "provider"))
        if d is not None and r is not d:
            t, t0 = answering.field(r, "tokens_per_s"), answering.field(d, "tokens_per_s")
            parts.append(f"{Path(name).name if name.endswith('.json') else name} {t:.0f} tokens/s ({t / t0:.2f}x dense {t0:.0f})")
    if not parts:
        return f"{doc['_path']}: no decode record next to a dense one."
    r0 = recs[0]
    return f"Decode on {r0['_device']} ({r0['_shape']} shape, batch {r0.get('batch')} x {r0.get('seq')} tokens): " + "; ".join(parts) + "."


def reading_bench(docs: list[dict[str, Any]]) -> str:
    parts = []
    for doc in docs:
        if doc.get("subcommand") == "decode":
            parts.append(reading_decode(doc))
            continue
        recs = [r for r in doc["records"] if r.get("status", "ok") == "ok" and r.get("median_us")]
        ours = [r for r in recs if r["provider"].endswith("_triton") or r["provider"].startswith("kvtool")]
        base = set(doc.get("primary_baselines") or [])
        mine = []
        for r in ours[:4]:
            peers = [p for p in recs if p["provider"] in base and (p.get("batch"), p.get("seq")) == (r.get("batch"), r.get("seq"))]
            if peers:
                fastest = min(peers, key=lambda p: p["median_us"])
                mine.append(f"{r['kernel']} ({r['provider']}, batch {r.get('batch')}, {r.get('seq')} tokens"
                             + (f", {r['sparsity']:.0%} sparse" if r.get("sparsity") is not None else "")
                             + f"): {r['median_us']:.1f} µs vs {fastest['provider']} {fastest['median_us']:.1f} µs ({fastest['median_us'] / r['median_us']:.2f}x)")
        dev = (doc.get("env") or {}).get("device", "?")
        parts.append(f"On {dev}: " + "; ".join(mine) + "." if mine else f"{doc['_path']}: no kvtool kernel records next to a baseline.")
    return " ".join(parts)


# ----------------------------------------------------------------------------- HTML


CSS = ("body{font:15px/1.5 system-ui,sans-serif;max-width:1320px;margin:.8em auto;padding:0 1em;color:#222}"
       "h1{font-size:1.35em;margin:.2em 0}h1 .muted{font-weight:normal;font-size:.6em;margin-left:.6em}"
       "h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}"
       "#answer h2{margin-top:.4em;font-size:1.2em}table.answer{font-size:.82em;width:100%}table.answer td{vertical-align:top}"
       "table.answer th,table.answer td.words,table.answer td.fid{text-align:left}table.answer td.cmd{text-align:left;overflow-wrap:anywhere;width:30%}"
       "table.answer td.cmd code{font-size:.88em;background:none}"
       "table.answer tr.uniform td{color:#555;font-size:.95em;background:#fafafa}table.answer tr.plan td{border-top:2px solid #bbb}"
       "ol.sentences{font-size:.84em;line-height:1.35;margin:.3em 0;padding-left:1.4em}.small{font-size:.78em}"
       ".beside{display:flex;gap:.8em;align-items:flex-start}.beside img{min-width:0;flex:0 1 auto}"
       "table.numbered{font-size:.74em;flex:none}table.numbered td.spec{text-align:left;white-space:nowrap}"
       "#answer p.reading{margin:.3em 0;padding:.3em .8em;font-size:.9em}th .sub{font-weight:normal;font-size:.85em;color:#555}"
       "table{border-collapse:collapse;margin:.6em 0;font-size:.88em}td,th{border:1px solid #ddd;padding:.25em .5em;text-align:right}"
       "th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}"
       "p.reading{background:#f6f8fa;border-left:4px solid #0072B2;padding:.5em .8em}"
       "img{max-width:100%;border:1px solid #eee;margin:.4em 0}code{font-size:.9em;background:#f4f4f4;padding:0 .2em}"
       "nav a{margin-right:1em}.muted{color:#666;font-size:.9em}"
       "td.good{background:#e6f4ea;color:#0b6b2b}td.fair{background:#fff6d5;color:#7a5a00}td.poor{background:#fde2e1;color:#a40e0e;font-weight:600}"
       "td.noise{color:#888}")


class Cell:
    """A table cell with a CSS class: a fidelity number coloured by its band (kvtool.analysis.bands)."""

    def __init__(self, text: str, css: str = ""):
        self.text, self.css = text, css

    @classmethod
    def of(cls, metric: str, value: float | None, text: str) -> "Cell":
        return cls(text, grade(metric, value) or "")

    def html(self) -> str:
        return f'<td class="{self.css}">{html.escape(self.text)}</td>' if self.css else f"<td>{html.escape(self.text)}</td>"


def _table(cols: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(v.html() if isinstance(v, Cell) else f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def nll_text(v: float | None, words: bool = True) -> str:
    """An NLL increase in nats/token, signed, 4 decimals; a negative one marked ``*`` (and, with
    ``words``, said to be noise)."""
    if v is None:
        return "-"
    if v < 0:
        return f"{v:+.4f}*" + (" nats/token (negative: noise)" if words else "")
    return f"{v:+.4f}" + (" nats/token" if words else "")


NOISE_NOTE = ("* a negative NLL increase means the compressed cache predicted that text slightly better than the dense one; "
              "at these sizes it is noise, not a gain (docs/fidelity.md).")
BAND_NOTE = ("Colours: green good, yellow fair, red poor, grey noise (bands in docs/fidelity.md, Reading the numbers: "
             "NLL increase good <= 0.01 nats/token, fair <= 0.05; top-1 agreement good >= 0.95, fair >= 0.85; KL good <= 0.01, fair <= 0.05).")


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _section(sid: str, title: str, reading: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2><p class="reading">{html.escape(reading)}</p>{body}</section>'


def build_report(
    capture: Path,
    budgets: tuple[str, ...] | list[str] = DEFAULT_BUDGETS,
    eval_dir: Path | None = None,
    bench: list[Path] | None = None,
    use_model: bool = True,
    use_texts: bool = True,
    model: str | None = None,
    heldout: int = 64,
    uniform_checks: int | None = None,
    progress: Progress | None = None,
    command: str | None = None,
    device: str | None = "auto",
    tasks_dir: Path | None = None,
    batch: int = answering.DEFAULT_BATCH,
    context: int = answering.DEFAULT_CONTEXT,
) -> tuple[str, dict[str, Any]]:
    """The report's HTML text and a summary dict (sections, figure count, per-budget numbers).
    ``command``: the command line that made the report, shown with the ones that reproduce its plans.
    ``device``: where the recommendation scores candidates and runs the model (auto: CUDA when present).
    ``tasks_dir``: a ``kvtool tasks`` folder whose accuracy table and frontier become a section.
    ``batch``, ``context``: the batch and context (tokens) at which the first screen gives each
    plan's GiB."""
    if batch < 1 or context < 1:
        raise UsageError(f"--batch and --context must be at least 1, got {batch} and {context}")
    eval_rows, eval_other = read_eval_of(eval_dir, capture) if eval_dir else (None, [])
    task_summary = read_tasks(tasks_dir) if tasks_dir else None
    bench_docs = read_bench(bench or [])
    cache = io.load(capture, parts=("keys", "values", "queries"))
    facts = cache.facts
    tasks_model = ((task_summary or {}).get("run") or {}).get("model")
    same_model = tasks_model is None or tasks_model == facts.name  # a tasks run of another model answers nothing about this capture
    progress = or_silent(progress)
    progress.stage("cache statistics")
    cut = cut_summary(cache)
    rec = recommend_capture(capture, list(budgets), batch=batch, context=str(context), heldout=heldout, model=model, use_model=use_model, use_texts=use_texts,
                            uniform_checks=uniform_checks, progress=progress, device=device)
    progress.stage("figures")
    figures = 0
    sections = []
    elt = 2 if facts.dtype in ("float16", "bfloat16") else 4
    per_token = 2 * facts.num_layers * facts.num_kv_heads * facts.head_dim * elt
    facts_rows = [["model", facts.name], ["architecture", facts.architecture], ["layers", facts.num_layers],
                  ["query heads / KV heads", f"{facts.num_heads} / {facts.num_kv_heads}"], ["head dim", facts.head_dim],
                  ["dtype (capture)", facts.dtype], ["tokens captured", cache.num_tokens], ["layers captured", len(cache.layers)],
                  ["dense KV bytes per token", f"{per_token:,}"],
                  [f"dense KV at batch {batch} x {context:,} tokens", f"{per_token * batch * context / 1024**3:.2f} GiB"]]
    sections.append(_section("model", "Model and capture",
                             f"{facts.name}: {facts.num_layers} layers with {facts.num_kv_heads} KV heads of {facts.head_dim} dims "
                             f"({facts.num_heads // max(1, facts.num_kv_heads)} query heads per KV head), so each token costs {per_token:,} bytes of "
                             f"{facts.dtype} keys and values; this capture holds {cache.num_tokens} tokens of {len(cache.layers)} layers.",
                             _table(["fact", "value"], facts_rows)))
    body = _img(fig_png(cut_map_figure(cut["layers"])), "per-layer cut map"); figures += 1
    body += _img(fig_png(outlier_map_figure(cut["ratios"], facts, cut["factor"])), "outlier channel map"); figures += 1
    if cut["attention"]:
        mid = sorted(cut["attention"])[len(cut["attention"]) // 2]
        body += _img(fig_png(concentration_figure(cut["attention"][mid], facts, mid)), f"attention concentration, layer {mid}"); figures += 1
        body += _img(fig_png(head_importance_figure(cut["attention"][mid], facts, mid)), f"head importance, layer {mid}"); figures += 1
    sections.append(_section("cut", "Where the cache can be cut", reading_cut(cut), body))
    n_layers = len(cache.layers)
    plans_pts = [{"storage_ratio": b["predicted"]["exact_storage_ratio"], "loss": b["predicted"]["loss"], "budget": b["budget"]} for b in rec["budgets"]]
    region = max((b["fraction"] for b in rec["budgets"]), default=None)
    body = ('<div class="beside">' + _img(fig_png(attention_frontier_figure(rec["sensitivity"]["uniform"], plans_pts, n_layers, region)), "attention-level frontier")
            + region_table(region_points(rec["sensitivity"]["uniform"], region), rec, n_layers) + "</div>"); figures += 1
    body += '<p class="muted">Every candidate applied to every layer (dots, one colour per format) and the recommended plans (stars). ' \
            "Error: RMS over layers of the held-out queries' attention-output relative error" + \
            (", each layer weighted by its measured cost on the model." if rec.get("layer_weights") else ".") + " Dense (no error) is not drawn on the log axis.</p>"
    if any(b.get("check") for b in rec["budgets"]):
        body += _img(fig_png(model_cost_figure(rec["budgets"])), "model-level cost"); figures += 1
    if eval_other:
        body += (f'<p class="muted">--eval {html.escape(str(eval_dir))}: its points are of {html.escape(", ".join(eval_other))}, not of '
                 f"{html.escape(capture.name)}; left out (run kvtool eval {html.escape(capture.name)} -o DIR).</p>")
    if eval_rows:
        fig, ax = _figure(8.5, 5.2)
        metric = "agreement" if any(r.get("agreement") is not None for r in eval_rows) else "rel_l2"
        caps = sorted({Path(r.get("capture", "?")).name for r in eval_rows})
        plot_frontier(eval_rows, Path("unused.png"), metric, title=f"kvtool eval of {', '.join(caps)}: {len(eval_rows)} points", ax=ax)
        body += _img(fig_png(fig), "eval frontier"); figures += 1
    sections.append(_section("frontier", "Frontier of every format", reading_frontier(rec), body))
    body = _img(fig_png(plan_mix_figure(rec["budgets"], facts.num_kv_heads)), "plan composition"); figures += 1
    readings = []
    negative = False
    for b in rec["budgets"]:
        readings.append(reading_budget(b, rec["cases"]))
        rows = []
        many = len(rec["cases"]) > 1
        for label, sc in (b.get("check") or {}).items():
            c0 = sc["cases"][0]
            row = [label if label == b["plan_label"] else f"uniform {label}" + (" (best uniform)" if label == b["best_uniform"] else ""),
                   pct(c0["storage_ratio"]), Cell.of("nll_increase", c0["nll_increase"], nll_text(c0["nll_increase"], words=False)),
                   Cell.of("agreement", c0["agreement"], f"{c0['agreement']:.4f}"), Cell.of("kl", c0["kl"], f"{c0['kl']:.4f}")]
            if many:
                iv, ag = sc["nll_increase"], sc["agreement"]
                row += [Cell.of("nll_increase", iv["mean"], _ci_text(iv, nll=True)), Cell.of("agreement", ag["mean"], _ci_text(ag, nll=False))]
            negative |= c0["nll_increase"] < 0 or (many and sc["nll_increase"]["mean"] is not None and sc["nll_increase"]["mean"] < 0)
            rows.append(row)
        body += f"<h3>budget {html.escape(b['budget'])}</h3><p>{html.escape(readings[-1])}</p>"
        if rows:
            cols = ["setting", "stored", f"NLL + ({rec['cases'][0]}, nats/token)", f"top-1 ({rec['cases'][0]})", f"KL ({rec['cases'][0]}, nats)"]
            if many:
                cols += [f"NLL + mean [95%] over {len(rec['cases'])} cases", "top-1 mean [95%]"]
            body += _table(cols, rows)
        counts: dict[str, int] = {}
        for specs in b["plan"].layers.values():
            for s in specs * (facts.num_kv_heads if len(specs) == 1 else 1):
                counts[s] = counts.get(s, 0) + 1
        body += _table(["format in the plan", "KV heads"], sorted(([s, n] for s, n in counts.items()), key=lambda r: -r[1]))
    if negative:
        body += f'<p class="muted">{html.escape(NOISE_NOTE)}</p>'
    body += f'<p class="muted">{html.escape(BAND_NOTE)}</p>'
    body += "<p class=\"muted\">Reproduce: " + "<br>".join(f"<code>{html.escape(c)}</code>" for c in ([command] if command else []) + reproduce(capture, budgets, eval_dir, bench, use_model, use_texts, model, heldout, uniform_checks)) + \
            f"<br>Cases: {html.escape(', '.join(rec['cases']) or 'none (no model check)')}.</p>"
    sections.append(_section("recommend", "Recommendation per budget", " ".join(readings[:2]) if readings else "No budgets.", body))
    if task_summary is not None:
        body, n_fig = tasks_section(task_summary)
        figures += n_fig
        other = "" if same_model else f"These tasks ran on {tasks_model}, not on {facts.name} (this capture's model): they are left out of the first screen. "
        sections.append(_section("tasks", "Long-context tasks (question after compression)", other + reading_tasks(task_summary), body))
    else:
        sections.append(_section("tasks", "Long-context tasks (question after compression)",
                                 "No tasks folder was given: run kvtool tasks --methods dense,kivi,... --budgets 15% --out-dir tasks.out and pass --tasks tasks.out.", ""))
    if bench_docs:
        body = ""
        for doc in bench_docs:
            recs = [r for r in doc["records"] if r.get("median_us")]
            if recs:
                body += _img(fig_png(bench_figure(recs)), f"bench {doc.get('subcommand')}"); figures += 1
            env = doc.get("env") or {}
            body += f"<p class=\"muted\">{html.escape(doc['_path'])}: {html.escape(str(doc.get('command', '')))} on {html.escape(str(env.get('device', '?')))}, {html.escape(str(doc.get('date', '')))}</p>"
        sections.append(_section("kernels", "Kernel timings", reading_bench(bench_docs), body))
    else:
        sections.append(_section("kernels", "Kernel timings", "No bench JSON was given: run kvtool bench decode --plan plan-15.json -o decode.json (or kvtool bench attention -o att.json) on a GPU and pass --bench decode.json.", ""))
    links = {}
    for b in rec["budgets"]:
        name = f"plan-{b['budget'].rstrip('%')}.json"
        links[b["budget"]] = name
        links["_data:" + b["budget"]] = "data:application/json;base64," + base64.b64encode(json.dumps(b["plan"].to_dict(), indent=1).encode()).decode()
    answers, first = answering.first_screen(rec, facts, capture, batch, context, bench_docs, task_summary if same_model else None, len(cache.layers), links)
    sections.insert(0, f'<section id="answer"><h2>What to use at each budget</h2>{first}</section>')
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = "".join(f'<a href="#{s}">{s}</a>' for s in SECTIONS)
    doc = (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>kvtool report: {html.escape(capture.name)}</title>"
           f"<style>{CSS}</style></head><body><h1>KV-cache report: {html.escape(capture.name)} "
           f"<span class=\"muted\">{html.escape(facts.name)}, generated {when} by kvtool in {rec['seconds']:.0f} s</span></h1><nav>{nav}</nav>"
           + "".join(sections) + "</body></html>\n")
    summary = {"sections": list(SECTIONS), "figures": figures, "seconds": rec["seconds"], "cases": rec["cases"],
               "budgets": [{"budget": b["budget"], "storage_ratio": b["predicted"]["exact_storage_ratio"], "reading": r} for b, r in zip(rec["budgets"], readings)],
               "answers": answers}
    return doc, summary


def _ci_text(iv: dict[str, Any], nll: bool) -> str:
    """``mean [lo, hi]``: NLL increases signed with 4 decimals (``*`` on a negative mean), other
    metrics with 4 decimals."""
    if not iv or iv.get("mean") is None:
        return "-"
    f = (lambda v: f"{v:+.4f}") if nll else (lambda v: f"{v:.4f}")
    mean = f(iv["mean"]) + ("*" if nll and iv["mean"] < 0 else "")
    return mean if iv["n"] < 2 else f"{mean} [{f(iv['lo'])}, {f(iv['hi'])}]"


def reproduce(capture: Path, budgets: Any, eval_dir: Path | None, bench: list[Path] | None, use_model: bool, use_texts: bool,
              model: str | None, heldout: int, uniform_checks: int | None) -> list[str]:
    """The commands that make the same plans (one per budget) and compress with them, with every
    option this report used."""
    common = [f"--heldout {heldout}"] + ([f"--model {model}"] if model else []) + ([] if use_model else ["--no-model"]) + \
             ([] if use_texts else ["--no-texts"]) + ([] if uniform_checks is None else [f"--uniform-checks {uniform_checks}"])
    lines = []
    for b in budgets:
        plan = f"plan-{str(b).rstrip('%')}.json"
        lines.append(f"kvtool recommend {capture} --budget {b} {' '.join(common)} -o {plan} && kvtool compress {capture} --plan {plan} --heldout {heldout} -o plan-{str(b).rstrip('%')}.safetensors")
    return lines
