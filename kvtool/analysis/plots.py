"""Figures of a capture (matplotlib, Agg canvas, no pyplot and no global backend state).

Every ``*_figure`` function builds and returns a :class:`matplotlib.figure.Figure` of
:data:`FIGSIZE` inches (saved at :data:`DPI`, so PNGs are ``FIGSIZE * DPI`` pixels), titled with the
model, layer, head and what it shows, with labelled axes and a colour bar wherever colour carries a
value. :func:`save_figure` writes one atomically; :func:`write_plot_set` plans, checks and writes a
whole set, and :func:`write_index` the index.html that shows it.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from kvtool.core import io
from kvtool.core.cache import KVCache, ModelFacts
from kvtool.core.errors import BadDataError, OutputExistsError, UsageError
from kvtool.core.io import atomic_write_bytes, check_output
from kvtool.analysis.stats import (
    LayerAttention,
    StatsSettings,
    attention_summary,
    channel_mean_abs,
    head_rows,
    heads_for_norm,
    layer_attention,
    median,
    outlier_ratios,
    token_mask,
)

FIGSIZE = (9.0, 5.5)
DPI = 100
FORMATS = ("png", "svg", "pdf")
KINDS = ("heatmap", "profile", "histogram", "outliers", "concentration", "heads")
QUERY_KINDS = ("concentration", "heads")
HEATMAP_CMAP = "magma"  # luminance rises monotonically with the value

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Figure, Any]:
    """A figure of FIGSIZE with a subplot grid, constrained layout, and an Agg canvas (matplotlib is
    imported here, not at module import, so the CLI starts fast)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=True, **kwargs)
    return fig, axes


def title(facts: ModelFacts, what: str, layer: int | None = None, head: int | str | None = None) -> str:
    """``"<model> · layer L · KV head H · <what>"`` (parts left out when None)."""
    parts = [facts.name]
    if layer is not None:
        parts.append(f"layer {layer}")
    if head is not None:
        parts.append(f"KV head {head}" if isinstance(head, int) else str(head))
    parts.append(what)
    return " · ".join(parts)


def heatmap_figure(x: torch.Tensor, facts: ModelFacts, layer: int, head: int, part: str, token_label: str = "token",
                   vmax: float | None = None) -> Figure:
    """Magnitude heatmap of one KV head: x ``[N, D]`` (token rows) drawn as |x|, tokens down, channels
    across, colour bar in |x| units; ``token_label`` names the row axis. ``vmax``: the top of the
    colour scale (a plot set passes one value per layer and part, shared by that layer's heads, so
    that colours compare across heads while a layer of small values, often layer 0, is not drawn
    black on another layer's scale; default this heatmap's maximum)."""
    fig, ax = new_figure()
    data = x.float().abs().numpy()
    shared = vmax is not None
    top = (vmax if shared else float(data.max())) or 1.0
    im = ax.imshow(data, aspect="auto", cmap=HEATMAP_CMAP, interpolation="nearest", vmin=0.0, vmax=top)
    ax.set_xlabel("channel")
    ax.set_ylabel(token_label)
    ax.set_title(title(facts, f"|{part}| per token and channel", layer, head), fontsize=10)
    fig.colorbar(im, ax=ax, label=f"|{part[0].upper()}|" + (f" (0 to {top:.3g}: the scale of every {part} heatmap of layer {layer})" if shared else ""))
    return fig


def profile_figure(keys: torch.Tensor, values: torch.Tensor, facts: ModelFacts, layer: int, head: int, factor: float) -> Figure:
    """Per-channel mean |K| and |V| (keys, values ``[N, D]``) as bars; outlier channels (>= factor x
    median channel) in red and labelled, the threshold as a dashed line."""
    fig, axes = new_figure(2, 1, sharex=True)
    for ax, x, part in zip(axes, (keys, values), ("keys", "values")):
        means = channel_mean_abs(x)
        ratios = outlier_ratios(means)
        out = (ratios >= factor).numpy()
        chans = np.arange(means.numel())
        ax.bar(chans, means.numpy(), color=np.where(out, "tab:red", "tab:blue"), width=0.85)
        ax.axhline(factor * median(means), color="black", linestyle="--", linewidth=1, label=f"{factor:g} x median channel")
        for c in np.nonzero(out)[0]:
            ax.annotate(str(c), (c, float(means[c])), ha="center", va="bottom", fontsize=8, color="tab:red")
        ax.set_ylabel(f"mean |{part[0].upper()}|")
        ax.set_ylim(0, max(float(means.max()), factor * median(means)) * 1.2)  # room above the tallest bar for its label
        ax.set_xlim(-1.5, means.numel() + 0.5)  # and beside the first and last channel
        ax.set_title(f"{part}: {int(out.sum())} outlier channel(s)", fontsize=9)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("channel")
    fig.suptitle(title(facts, "per-channel mean magnitude (outliers red)", layer, head), fontsize=10)
    return fig


def histogram_figure(keys: torch.Tensor, values: torch.Tensor, facts: ModelFacts, layer: int, head: int | str) -> Figure:
    """Histograms of |K| and |V| (any shapes) with a log count axis."""
    fig, axes = new_figure(1, 2)
    for ax, x, part, colour in zip(axes, (keys, values), ("keys", "values"), ("tab:blue", "tab:orange")):
        data = x.float().abs().reshape(-1).numpy()
        ax.hist(data, bins=100, color=colour, log=True)
        ax.set_xlabel(f"|{part[0].upper()}|")
        ax.set_ylabel("elements (log scale)")
        ax.set_title(f"{part}: max {data.max():.3g}, p99 {np.percentile(data, 99):.3g}", fontsize=9)
    fig.suptitle(title(facts, "histogram of magnitudes", layer, head), fontsize=10)
    return fig


def outlier_map_figure(ratios: dict[str, dict[tuple[int, int], torch.Tensor]], facts: ModelFacts, factor: float) -> Figure:
    """Outlier map: rows (layer, KV head), columns channels, colour = channel mean |x| / median channel,
    for keys and values side by side; cells >= ``factor`` marked. ``ratios``: {part: {(layer, head): [D]}}."""
    fig, axes = new_figure(1, 2, sharey=True)
    vmax = 2.5 * factor
    im = None
    for ax, part in zip(axes, ("keys", "values")):
        rows = sorted(ratios[part])
        data = torch.stack([ratios[part][r] for r in rows]).numpy()
        im = ax.imshow(np.minimum(data, vmax), aspect="auto", cmap="viridis", interpolation="nearest", vmin=0, vmax=vmax)
        ys, xs = np.nonzero(data >= factor)
        ax.scatter(xs, ys, marker="x", s=14, color="red", linewidths=0.8, label=f">= {factor:g} x median")
        first = [i for i, (l, h) in enumerate(rows) if i == 0 or rows[i - 1][0] != l]
        ax.set_yticks(first, [f"L{rows[i][0]}" for i in first], fontsize=7)
        ax.set_xlabel("channel")
        ax.set_title(f"{part}: {len(xs)} outlier cells", fontsize=9)
        ax.legend(loc="lower right", fontsize=7)
    axes[0].set_ylabel(f"layer (one row per KV head, {facts.num_kv_heads} per layer)")
    fig.colorbar(im, ax=axes, label=f"mean |x| / median channel (clipped at {vmax:g})")
    fig.suptitle(title(facts, "outlier channels over layers"), fontsize=10)
    return fig


def concentration_figure(att: LayerAttention, facts: ModelFacts, layer: int, heads: list[int] | None = None) -> Figure:
    """Share of attention mass (mean over sampled queries) vs keys kept, largest first, one line per
    query head (``heads``: query heads to draw, default all); 90% / 99% marked."""
    fig, ax = new_figure()
    heads = list(range(att.curve.shape[0])) if heads is None else heads
    kept = att.curve_kept.numpy()
    for h in heads:
        ax.plot(kept, att.curve[h].numpy(), label=f"q head {h} (KV {h // att.group})", linewidth=1.3)
    for m in (0.9, 0.99):
        ax.axhline(m, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(f"{m:.0%}", (kept[0], m), va="bottom", fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("keys kept (largest attention first, log scale)")
    ax.set_ylabel("share of attention mass (mean over queries)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title(f"{att.visible.numel()} sampled queries (causal), mean {att.visible.float().mean():.0f} keys seen", fontsize=9)
    fig.suptitle(title(facts, "attention concentration", layer, "all query heads"), fontsize=10)
    return fig


def head_importance_figure(att: LayerAttention, facts: ModelFacts, layer: int, masses: tuple[float, ...] = (0.9, 0.99)) -> Figure:
    """Head importance: mean output norm per query head, sorted, with the cumulative norm share and
    the per-query mean number of heads needed for each share in ``masses`` (the selective-head cut-off)."""
    fig, ax = new_figure()
    norms = att.out_norm.mean(1)
    order = torch.argsort(norms, descending=True)
    pos = np.arange(1, len(order) + 1)
    ax.bar(pos, norms[order].numpy(), color="tab:blue", label="mean output norm")
    ax.set_xticks(pos, [str(int(h)) for h in order], fontsize=8)
    ax.set_xlabel("query head (sorted by mean output norm)")
    ax.set_ylabel("mean ||head output|| over queries")
    ax2 = ax.twinx()
    ax2.plot(pos, (norms[order].cumsum(0) / norms.sum()).numpy(), color="black", marker="o", markersize=3, label="cumulative share")
    ax2.set_ylabel("cumulative share of output norm")
    ax2.set_ylim(0, 1.05)
    for m, style in zip(masses, ("--", ":")):
        need = float(heads_for_norm(att.out_norm, m).float().mean())
        ax.axvline(need + 0.5, color="tab:red", linestyle=style, label=f"{m:.0%} of norm: {need:.2f} heads per query")
    handles = ax.get_legend_handles_labels()
    extra = ax2.get_legend_handles_labels()
    fig.legend(handles[0] + extra[0], handles[1] + extra[1], loc="outside lower center", ncols=2, fontsize=8)
    ax.set_title(title(facts, "head importance (Polar Sparsity output norms)", layer, "all query heads"), fontsize=10)
    return fig


def save_figure(fig: Figure, path: Path, fmt: str, force: bool = False) -> Path:
    """Write ``fig`` to ``path`` in ``fmt`` (png/svg/pdf) atomically, at DPI, without cropping
    (replacing an existing file only with ``force``)."""
    with io.atomic_path(path, force) as tmp:
        fig.savefig(tmp, format=fmt, dpi=DPI)
    return path


# ----------------------------------------------------------------------------- plot sets


@dataclass(frozen=True)
class PlotSpec:
    """One file to write: ``kind`` (one of KINDS), ``layer``/``head`` where it applies, ``part``
    (keys/values for heatmaps), ``name`` the file name without extension."""

    kind: str
    name: str
    layer: int | None = None
    head: int | None = None
    part: str | None = None


def plan_plots(layers: list[int], heads: list[int], kinds: tuple[str, ...]) -> list[PlotSpec]:
    """The files for ``kinds`` over ``layers`` x KV ``heads``: heatmaps (keys and values) and profiles
    per layer and head, histograms / concentration / head importance per layer, one outlier map."""
    specs: list[PlotSpec] = []
    if "outliers" in kinds:
        specs.append(PlotSpec("outliers", "outlier-map"))
    for l in layers:
        for h in heads:
            if "heatmap" in kinds:
                specs += [PlotSpec("heatmap", f"heatmap-{p}-L{l:02d}-H{h}", l, h, p) for p in ("keys", "values")]
            if "profile" in kinds:
                specs.append(PlotSpec("profile", f"profile-L{l:02d}-H{h}", l, h))
        if "histogram" in kinds:
            specs.append(PlotSpec("histogram", f"histogram-L{l:02d}", l))
        if "concentration" in kinds:
            specs.append(PlotSpec("concentration", f"concentration-L{l:02d}", l))
        if "heads" in kinds:
            specs.append(PlotSpec("heads", f"heads-L{l:02d}", l))
    return specs


def prepare_folder(out_dir: Path, targets: list[Path], force: bool) -> None:
    """Create ``out_dir`` if needed (its parent must exist) and refuse existing targets without force."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} is a file, not a folder")
    if not out_dir.exists():
        parent = out_dir.parent
        if not parent.exists():
            raise UsageError(f"the folder {parent} does not exist")
        try:
            out_dir.mkdir()
        except OSError as exc:
            raise UsageError(f"cannot create the folder {out_dir} ({exc.strerror or exc})") from None
    import os

    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"the folder {out_dir} is not writable")
    existing = [p for p in targets if p.exists()]
    if existing and not force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise OutputExistsError(f"{existing[0]}{more}")


def write_plot_set(
    cache: KVCache,
    specs: list[PlotSpec],
    out_dir: Path,
    fmt: str = "png",
    settings: StatsSettings = StatsSettings(),
    outlier_layers: list[int] | None = None,
    force: bool = False,
    extra_targets: tuple[Path, ...] = (),
    progress: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Write every planned figure into ``out_dir`` (each file atomic); returns one dict per file
    (``path``, ``kind``, ``layer``, ``head``, ``part``, ``title``, and ``summary``: the numbers the
    figure shows that :func:`write_index` reads out). The heatmaps of one layer and part share one
    colour scale.

    Refuses before writing anything when a target exists and not ``force``. If a figure fails, the
    files (and folder) this call created are removed again. ``outlier_layers``: the map's layers
    (default all); ``extra_targets``: more files the caller will write (checked the same way)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown plot format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if any(s.kind in QUERY_KINDS for s in specs) and not cache.has_queries:
        raise BadDataError("the capture has no queries: attention plots need them; recapture without --no-queries")
    targets = [out_dir / f"{s.name}.{fmt}" for s in specs]
    made_folder = not out_dir.exists()
    prepare_folder(out_dir, targets + list(extra_targets), force)
    facts = cache.facts
    mask = token_mask(cache)
    token_label = "token" if cache.batch_size == 1 else f"token ({cache.batch_size} sequences stacked, padding dropped)"
    attention: dict[int, LayerAttention] = {}
    rows_cache: dict[tuple[int, str], torch.Tensor] = {}
    shared_vmax: dict[tuple[int, str], float] = {}

    def rows(layer: int, part: str) -> torch.Tensor:
        if (layer, part) not in rows_cache:
            rows_cache[(layer, part)] = head_rows(getattr(cache.layer(layer), part), mask)
        return rows_cache[(layer, part)]

    def att(layer: int) -> LayerAttention:
        if layer not in attention:
            attention[layer] = layer_attention(cache.layer(layer), facts, settings, cache.attention_mask)
        return attention[layer]

    def vmax(layer: int, part: str) -> float:
        """One colour scale for the heatmaps of ``part`` of ``layer`` in the set: their largest |x|
        (per layer: magnitudes differ by an order of magnitude from layer to layer)."""
        if (layer, part) not in shared_vmax:
            shared_vmax[(layer, part)] = max(float(rows(layer, part)[s.head].float().abs().max())
                                             for s in specs if s.kind == "heatmap" and s.part == part and s.layer == layer)
        return shared_vmax[(layer, part)]

    created: list[Path] = []
    written: list[dict[str, Any]] = []
    try:
        for spec, path in zip(specs, targets):
            l, h = spec.layer, spec.head
            summary: dict[str, Any] = {}
            if spec.kind == "heatmap":
                fig = heatmap_figure(rows(l, spec.part)[h], facts, l, h, spec.part, token_label, vmax=vmax(l, spec.part))
                summary = {"max_abs": float(rows(l, spec.part)[h].float().abs().max()), "vmax": vmax(l, spec.part)}
            elif spec.kind == "profile":
                fig = profile_figure(rows(l, "keys")[h], rows(l, "values")[h], facts, l, h, settings.outlier_factor)
                summary = {part: [int(c) for c in torch.nonzero(outlier_ratios(channel_mean_abs(rows(l, part)[h])) >= settings.outlier_factor).flatten()]
                           for part in ("keys", "values")}
            elif spec.kind == "histogram":
                fig = histogram_figure(rows(l, "keys"), rows(l, "values"), facts, l, "all KV heads")
                summary = {part: float(rows(l, part).float().abs().max()) for part in ("keys", "values")}
            elif spec.kind == "outliers":
                lays = outlier_layers or cache.layer_indices
                ratios = {
                    part: {(li, hh): outlier_ratios(channel_mean_abs(r)) for li in lays for hh, r in enumerate(rows(li, part))}
                    for part in ("keys", "values")
                }
                fig = outlier_map_figure(ratios, facts, settings.outlier_factor)
                summary = {part: {"rows": len(ratios[part]), "cells": int(sum(int((r >= settings.outlier_factor).sum()) for r in ratios[part].values())),
                                  "channels": _frequent([int(c) for r in ratios[part].values() for c in torch.nonzero(r >= settings.outlier_factor).flatten()])}
                           for part in ("keys", "values")}
            elif spec.kind == "concentration":
                fig = concentration_figure(att(l), facts, l)
                summary = attention_summary(att(l), settings)["all_heads"]
            elif spec.kind == "heads":
                fig = head_importance_figure(att(l), facts, l, settings.attention_masses)
                summary = attention_summary(att(l), settings)["all_heads"]
            else:
                raise UsageError(f"unknown plot kind {spec.kind!r}: choose from {', '.join(KINDS)}")
            existed = path.exists()
            save_figure(fig, path, fmt, force)
            if not existed:
                created.append(path)
            written.append({"path": str(path), "kind": spec.kind, "layer": l, "head": h, "part": spec.part, "title": fig_title(fig), "summary": summary})
            if progress is not None:
                progress()
    except BaseException:
        for p in created:
            p.unlink(missing_ok=True)
        if made_folder and out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    return written


def _frequent(channels: list[int], top: int = 5) -> list[int]:
    """The channels that occur most often, most frequent first (ties: lower first)."""
    counts: dict[int, int] = {}
    for c in channels:
        counts[c] = counts.get(c, 0) + 1
    return [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]


def fig_title(fig: Figure) -> str:
    """The figure's title (suptitle, else its first axes' title)."""
    if fig._suptitle is not None:  # matplotlib keeps the suptitle here; there is no public getter
        return fig._suptitle.get_text()
    return fig.axes[0].get_title() if fig.axes else ""


KIND_HEADINGS = {
    "outliers": "Outlier channels over layers",
    "heatmap": "Magnitude heatmaps (tokens x channels)",
    "profile": "Per-channel mean magnitude",
    "histogram": "Histograms of |K| and |V|",
    "concentration": "Attention concentration",
    "heads": "Head importance (output norms)",
}

INDEX_CSS = ("body{font:15px/1.5 system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1.5em;color:#222}"
             "h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2.2em}h3{margin:1.2em 0 .3em}"
             "nav ol{columns:2;margin:.4em 0}p.reading{background:#f6f8fa;border-left:4px solid #0072B2;padding:.5em .8em;max-width:70em}"
             ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em}"
             "figure{margin:0}img,object{width:100%;height:auto;border:1px solid #ddd}figcaption{font-size:.85em;color:#444}"
             "code{background:#f4f4f4;padding:0 .2em}")


def _layers_text(values: dict[int, str]) -> str:
    return ", ".join(f"layer {l}: {v}" for l, v in sorted(values.items()))


def index_reading(kind: str, group: list[dict[str, Any]], factor: float) -> str:
    """A short reading of one section of index.html, from the numbers its figures show."""
    sums = [f.get("summary") or {} for f in group]
    if kind == "outliers":
        k, v = sums[0].get("keys", {}), sums[0].get("values", {})
        top = lambda p: f", most often channel{'s' if len(p['channels']) > 1 else ''} {', '.join(map(str, p['channels']))}" if p.get("channels") else ""  # noqa: E731
        return (f"Each row is one KV head of one layer; a cell is a channel's mean |x| over the median channel's. Keys: {k.get('cells', 0)} "
                f"cells of {k.get('rows', 0)} rows reach {factor:g}x{top(k)}. Values: {v.get('cells', 0)} cells{top(v)}. Channels that "
                "stay outliers from layer to layer are why per-channel quantisation (KIVI) treats keys differently from values.")
    if kind == "heatmap":
        scales = {part: {f["layer"]: f"0 to {f['summary']['vmax']:.3g}" for f in group if f.get("summary") and f["part"] == part} for part in ("keys", "values")}
        peak = max(group, key=lambda f: (f.get("summary") or {}).get("max_abs", 0))
        return (f"{len(group)} heatmaps, tokens down and channels across. Each layer's key heatmaps share one colour scale "
                f"({_layers_text(scales['keys']) or '-'}) and its value heatmaps another ({_layers_text(scales['values']) or '-'}), so brightness "
                "compares across the heads of a layer; magnitudes differ by up to an order of magnitude between layers, so compare layers by their scales. "
                f"The largest magnitude is in layer {peak['layer']}, KV head {peak['head']} ({peak['part']}, {peak['summary']['max_abs']:.3g}); "
                "bright vertical stripes are outlier channels, bright rows are tokens (often the first, the attention sink).")
    if kind == "profile":
        found = {f"L{f['layer']} H{f['head']}": f["summary"] for f in group if f.get("summary")}
        keys = "; ".join(f"{n}: {', '.join(map(str, s['keys']))}" for n, s in found.items() if s.get("keys")) or "none"
        vals = "; ".join(f"{n}: {', '.join(map(str, s['values']))}" for n, s in found.items() if s.get("values")) or "none"
        return f"Channels whose mean |x| is at least {factor:g}x the median channel's (red bars). Keys: {keys}. Values: {vals}."
    if kind == "histogram":
        kmax = {f["layer"]: f"{f['summary']['keys']:.3g}" for f in group if f.get("summary")}
        vmax = {f["layer"]: f"{f['summary']['values']:.3g}" for f in group if f.get("summary")}
        return (f"Largest |K|: {_layers_text(kmax)}. Largest |V|: {_layers_text(vmax)}. The count axis is logarithmic: a long right tail of "
                "keys is the outlier channels; values usually stay compact.")
    if kind == "concentration":
        need = {f["layer"]: f"{100 * f['summary']['keys90_frac']:.1f}%" for f in group if f.get("summary") and "keys90_frac" in f["summary"]}
        return (f"Share of the keys a query sees that holds 90% of its attention mass (mean over query heads): {_layers_text(need)}. "
                "The lower it is, the more eviction or page selection can drop in that layer.")
    if kind == "heads":
        rows = [f["summary"] for f in group if f.get("summary") and "heads90" in f["summary"]]
        need = {f["layer"]: f"{f['summary']['heads90']:.2f}" for f in group if f.get("summary") and "heads90" in f["summary"]}
        share = sum(r["heads90_frac"] for r in rows) / len(rows) if rows else 1.0
        verdict = (f"on average {100 * share:.0f}% of the heads: few heads carry the output, so head selection (Polar Sparsity) has room"
                   if share < 0.6 else f"on average {100 * share:.0f}% of the heads: most heads matter, so head selection saves little here")
        return f"Query heads needed per query for 90% of the summed output norm: {_layers_text(need)}, {verdict}."
    return ""


def write_index(out_dir: Path, files: list[dict[str, Any]], facts: ModelFacts, source: Path, fmt: str, force: bool = False,
                outlier_factor: float = 4.0) -> Path:
    """index.html in ``out_dir``: a document of the figures in ``files`` (as written by
    :func:`write_plot_set`) with a table of contents, one section per kind with a short reading of
    its numbers, figures in a grid (grouped by layer where there are several per layer), each with
    its title as caption."""
    path = out_dir / "index.html"
    sections = [(kind, [f for f in files if f["kind"] == kind]) for kind in KIND_HEADINGS]  # the model-wide outlier map first
    sections = [(k, g) for k, g in sections if g]
    layers = sorted({f["layer"] for f in files if f["layer"] is not None})
    toc = "".join(f'<li><a href="#{k}">{KIND_HEADINGS[k]}</a> ({len(g)} figure{"s" if len(g) > 1 else ""})</li>' for k, g in sections)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kvtool plots: {html.escape(facts.name)}</title>",
        f"<style>{INDEX_CSS}</style>",
        "</head><body>",
        f"<h1>{html.escape(facts.name)}: what the KV cache looks like</h1>",
        f"<p>Capture <code>{html.escape(str(source))}</code>: {facts.num_layers} layers, {facts.num_heads} query heads, "
        f"{facts.num_kv_heads} KV heads, head_dim {facts.head_dim}, {html.escape(facts.dtype)}; figures of layer{'s' if len(layers) > 1 else ''} "
        f"{', '.join(map(str, layers))}. Written by <code>kvtool plot</code>; <code>kvtool stats</code> prints the same numbers as tables.</p>",
        f'<nav><h2 id="contents">Contents</h2><ol>{toc}</ol></nav>',
    ]
    for kind, group in sections:
        parts.append(f'<section id="{kind}"><h2>{KIND_HEADINGS[kind]}</h2>')
        parts.append(f'<p class="reading">{html.escape(index_reading(kind, group, outlier_factor))}</p>')
        by_layer = [(None, group)] if kind == "outliers" or len(layers) < 2 or len(group) == len({f["layer"] for f in group}) else \
            [(l, [f for f in group if f["layer"] == l]) for l in layers if any(f["layer"] == l for f in group)]
        for layer, figs in by_layer:
            if layer is not None:
                parts.append(f'<h3 id="{kind}-L{layer}">layer {layer}</h3>')
            parts.append('<div class="grid">')
            for f in figs:
                name = html.escape(Path(f["path"]).name)
                cap = html.escape(f["title"])
                media = (f'<object data="{name}" type="application/pdf" width="900" height="550"><a href="{name}">{name}</a></object>' if fmt == "pdf"
                         else f'<a href="{name}"><img src="{name}" alt="{cap}" loading="lazy"></a>')
                parts.append(f"<figure>{media}<figcaption>{cap}</figcaption></figure>")
            parts.append("</div>")
        parts.append('<p><a href="#contents">back to contents</a></p></section>')
    parts.append("</body></html>")
    return io.atomic_write_text(path, "\n".join(parts) + "\n", force=force)


def plot_curves(report: dict[str, Any], path: str | Path, force: bool = False) -> Path:
    """Error against attention density (oracle per layer and mean, group selection, router at k) as PNG."""
    import io as _io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_output(path, force)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, rep in report["layers"].items():
        ax.plot([r["density"] for r in rep["curve"]], [r["rel_l2"] for r in rep["curve"]], alpha=0.35, lw=1, label=f"oracle heads, layer {name}")
    ax.plot([r["density"] for r in report["curve"]], [r["rel_l2"] for r in report["curve"]], "k-o", lw=2, ms=3, label="oracle heads, mean")
    ax.plot([r["traffic_ratio"] for r in report["group_curve"]], [r["rel_l2"] for r in report["group_curve"]], "b--s", ms=4, label="oracle KV groups (x = KV traffic)")
    for who, marker in (("router", "r*"), ("static", "g^"), ("random", "mx")):
        if who in report["at_k"]:
            ax.plot([report["density"]], [report["at_k"][who]["rel_l2"]], marker, ms=10, label=f"{who} heads at k={report['k']}")
    ax.set_xlabel("attention density (heads computed / heads)")
    ax.set_ylabel("relative L2 error of the head outputs")
    ax.set_title(f"Selective head attention: {report['model']}", fontsize=9)
    ax.set_xlim(0, 1.02)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5)
    buf = _io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue(), force=force)
