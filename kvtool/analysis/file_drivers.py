"""The file-level drivers behind ``kvtool stats``, ``plot`` and ``heads``: read a capture (only the
layers and tensors asked for), compute, write what was asked, return the result as a dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.analysis.plots import FORMATS, KINDS, QUERY_KINDS, plan_plots, plot_curves, write_index, write_plot_set
from kvtool.analysis.stats import StatsSettings, capture_stats
from kvtool.core import io
from kvtool.core.cache import format_indices, parse_indices
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.placement import resolve_device
from kvtool.core.progress import Progress, or_silent
from kvtool.core.streaming import open_capture
from kvtool.methods.heads import analyse_heads, save_routers

# --sort keys that order smallest first (every statistic orders largest first)
SORT_ASCENDING = ("layer", "head")


def head_row(layer: int, head: dict[str, Any]) -> dict[str, Any]:
    """One flat row per (layer, KV head): the keys ``--sort`` can order by."""
    row: dict[str, Any] = {"layer": layer, "head": head["kv_head"]}
    for part, p in (("keys", "k"), ("values", "v")):
        s = head[part]
        row.update(
            {
                f"{p}_mean": s["mean_abs"],
                f"{p}_max": s["max_abs"],
                f"{p}_p99": s["p99"],
                f"{p}_p99.9": s["p99.9"],
                f"{p}_kurtosis": s["kurtosis"],
                f"{p}_outliers": s["outliers"],
                f"{p}_ratio": s["max_ratio"],
                f"{p}_top30": s.get("top30_share"),
                f"{p}_top50": s.get("top50_share"),
                f"{p}_entropy": s["code_entropy_raw"],
                f"{p}_entropy_mean": s["code_entropy_mean"],
                f"{p}_entropy_median": s["code_entropy_median"],
            }
        )
    att = head.get("attention")
    if att:
        for key in ("keys90", "keys90_frac", "keys99", "keys99_frac", "sink_share", "out_norm"):
            row[key] = att.get(key)
    return row


def sorted_rows(rows: list[dict[str, Any]], sort: str | None, top: int | None) -> list[dict[str, Any]]:
    """Rows ordered by ``sort`` (largest first; layer/head smallest first), the first ``top`` kept."""
    if sort is not None:
        if not rows or sort not in rows[0]:
            allowed = ", ".join(rows[0]) if rows else "layer, head"
            raise UsageError(f"cannot sort by {sort!r}: choose one of {allowed}")
        rev = sort not in SORT_ASCENDING
        rows = sorted(rows, key=lambda r: (r[sort] is None, -r[sort] if rev and r[sort] is not None else (r[sort] or 0), r["layer"], r["head"]))
    return rows[:top] if top is not None else rows


def stats_file(
    path: Path,
    layers: str | None = None,
    heads: str | None = None,
    settings: StatsSettings = StatsSettings(),
    attention: bool | None = None,
    sort: str | None = None,
    top: int | None = None,
    progress: Progress | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Read ``path`` one layer at a time (only the selected layers, queries only when needed) and
    compute the statistics, the attention part on ``device`` (default: CUDA when present); adds
    ``rows`` (the flat per-head rows, sorted and cut as asked)."""
    dev = resolve_device(device)
    meta, _ = io.read_header(path)
    io.check_schema(path, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(path, meta)
    layer_sel = parse_indices(layers, facts.num_layers, "layer") if layers else None
    head_sel = parse_indices(heads, facts.num_kv_heads, "KV head") if heads else None
    parts = ("keys", "values") if attention is False else ("keys", "values", "queries")
    cache = open_capture(path, layers=layer_sel, parts=parts)
    progress = or_silent(progress)
    progress.stage("stats", len(cache.layers))
    result = capture_stats(cache, layer_sel, head_sel, settings, attention, progress=lambda _: progress.advance(), device=dev)
    rows = [head_row(e["layer"], h) for e in result["layers"] for h in e["heads"]]
    result["rows"] = sorted_rows(rows, sort, top)
    return result


def parse_kinds(text: str | None) -> tuple[tuple[str, ...], bool]:
    """``"heatmap,profile"`` -> (kinds, explicit); None -> (all kinds, False)."""
    if text is None:
        return KINDS, False
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UsageError(f"unknown plot kind {bad[0] if bad else text!r}: choose from {', '.join(KINDS)}")
    return kinds, True


def default_out(path: Path) -> Path:
    return Path(f"{path.stem}-plots")


def plot_file(
    path: Path,
    out: Path | None = None,
    fmt: str = "png",
    layer: int | None = None,
    head: int | None = None,
    all_plots: bool = False,
    layers: str | None = None,
    heads: str | None = None,
    what: str | None = None,
    settings: StatsSettings = StatsSettings(),
    force: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Plan, check and write the figures; returns ``out``, ``files`` (one dict per file), ``index``
    (index.html with --all, else None) and ``skipped`` (kinds left out, with the reason)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}: choose one of {', '.join(FORMATS)}")
    kinds, explicit = parse_kinds(what)
    meta, entries = io.read_header(path)
    io.check_schema(path, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(path, meta)
    captured = io.layer_list(path, meta, facts)
    if all_plots and (layer is not None or head is not None):
        raise UsageError("--layer/--head pick one layer and head; with --all use --layers/--heads")
    if not all_plots and heads is not None:
        raise UsageError("--heads selects heads for --all; for single plots use --head H")
    layer_sel = parse_indices(layers, facts.num_layers, "layer") if layers else sorted(captured)
    missing = [l for l in layer_sel if l not in captured]
    if missing:
        raise UsageError(f"layer {missing[0]} is not in {path} (it has layers {format_indices(sorted(captured))})")
    if all_plots:
        plot_layers = layer_sel
        plot_heads = parse_indices(heads, facts.num_kv_heads, "KV head") if heads else list(range(facts.num_kv_heads))
    else:
        chosen = layer if layer is not None else sorted(captured)[len(captured) // 2]
        if chosen not in captured:
            raise UsageError(f"layer {chosen} is not in {path} (it has layers {format_indices(sorted(captured))})")
        h = 0 if head is None else head
        if not 0 <= h < facts.num_kv_heads:
            raise UsageError(f"KV head {h} is out of range: there are {facts.num_kv_heads} KV heads (0..{facts.num_kv_heads - 1})")
        plot_layers, plot_heads = [chosen], [h]
    has_queries = all(f"layers.{l}.queries" in entries for l in captured)
    skipped = []
    if not has_queries and not explicit:
        kinds = tuple(k for k in kinds if k not in QUERY_KINDS)
        skipped = [{"kind": k, "reason": "the capture has no queries; recapture without --no-queries"} for k in QUERY_KINDS]
    needs_queries = any(k in QUERY_KINDS for k in kinds)
    load_layers = sorted(set(plot_layers) | (set(layer_sel) if "outliers" in kinds else set()))
    parts = ("keys", "values", "queries") if needs_queries else ("keys", "values")
    cache = io.load(path, layers=load_layers, parts=parts)
    out = out or default_out(path)
    specs = plan_plots(plot_layers, plot_heads, kinds)
    index_path = out / "index.html"
    progress = or_silent(progress)
    progress.stage("plot", len(specs))
    files = write_plot_set(
        cache, specs, out, fmt, settings, outlier_layers=layer_sel, force=force,
        extra_targets=(index_path,) if all_plots else (), progress=lambda: progress.advance(),
    )
    index = write_index(out, files, facts, path, fmt, force=force, outlier_factor=settings.outlier_factor) if all_plots else None
    files = [{k: v for k, v in f.items() if k != "summary"} for f in files]  # the numbers index.html reads out
    return {"out": str(out), "format": fmt, "files": files, "index": None if index is None else str(index), "skipped": skipped}


def heads_file(
    capture: Path,
    k: int | None = None,
    heldout: int = 128,
    layers: str | None = None,
    router_out: Path | None = None,
    plot: Path | None = None,
    steps: int = 300,
    seed: int = 0,
    force: bool = False,
    progress: Progress | None = None,
    device: str | None = "auto",
) -> dict[str, Any]:
    """Analyse a capture's heads, optionally save the routers and a plot; returns the report (with
    ``router_file`` and ``plot_file`` when written). Layers are read one at a time onto ``device``
    (auto: CUDA when present), where the heads are scored and the routers trained."""
    dev = resolve_device(device)
    for out in (router_out, plot):
        if out is not None:
            io.check_output(out, force, inputs=(capture,))
    if router_out is not None and plot is not None and Path(router_out).resolve() == Path(plot).resolve():
        raise UsageError("--router-out and --plot name the same file")
    meta, _ = io.read_header(capture)
    io.check_schema(capture, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(capture, meta)
    selected = parse_indices(layers, facts.num_layers) if layers else None
    cache = open_capture(capture, layers=selected, device=dev)
    if not cache.has_queries:
        raise UsageError(f"{capture} has no queries; recapture without --no-queries")
    if router_out is not None and not cache.has_hidden:
        raise UsageError(f"--router-out needs hidden states, and {capture} has none; recapture with --hidden")
    if cache.batch_size > 1 and cache.attention_mask is not None and bool((cache.attention_mask == 0).any()):
        raise UsageError(f"{capture} holds a left-padded batch; recapture with --align truncate")
    progress = or_silent(progress)
    per_layer = 1 + (steps if cache.has_hidden else 0)  # the oracle curves, then one unit per router training step
    progress.stage("heads: oracle curves" + (" and router training steps" if cache.has_hidden else ", layers"), len(cache.layers) * per_layer)
    report, routers = analyse_heads(cache, k, heldout, router=True, steps=steps, seed=seed, progress=lambda i: progress.advance(),
                                    tick=progress.advance if cache.has_hidden else None)
    written = {}
    if router_out is not None:
        written["router_file"] = str(save_routers(router_out, routers, cache, report["k"], force=force))
    if plot is not None:
        written["plot_file"] = str(plot_curves(report, plot, force=force))
    return {**report, **written}
