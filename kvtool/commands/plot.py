"""``kvtool plot``: figures of a capture (see :mod:`kvtool.analysis.plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.core import io
from kvtool.core.cache import format_indices, parse_indices
from kvtool.core.errors import BadDataError, UsageError
from kvtool.analysis.plots import FORMATS, KINDS, QUERY_KINDS, plan_plots, write_index, write_plot_set
from kvtool.analysis.stats import StatsSettings
from kvtool.commands._common import (
    CaptureArg,
    DebugOpt,
    ForceOpt,
    JsonOpt,
    console,
    emit_json,
    example_epilog,
    kvtool_command,
    make_table,
    progress_bar,
)

ORDER = 35
SHORT_HELP = "Heatmaps, channel profiles, histograms, attention and head figures"


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


def make_plots(
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
    quiet: bool = True,
) -> dict[str, Any]:
    """Plan, check and write the figures; returns ``out``, ``files`` (one dict per file), ``index``
    (index.html with --all, else None) and ``skipped`` (kinds left out, with the reason)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}: choose one of {', '.join(FORMATS)}")
    kinds, explicit = parse_kinds(what)
    meta, entries = io.read_header(path)
    io.check_schema(path, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(path, meta)
    captured = io.parse_json_meta(path, meta, "kvtool.layers")
    if not captured:
        raise BadDataError(f"{path}: the capture holds no layers")
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
    with progress_bar(quiet) as bar:
        task = bar.add_task("plot", total=len(specs))
        files = write_plot_set(
            cache, specs, out, fmt, settings, outlier_layers=layer_sel, force=force,
            extra_targets=(index_path,) if all_plots else (), progress=lambda: bar.advance(task),
        )
    index = write_index(out, files, facts, path, fmt, force=force) if all_plots else None
    return {"out": str(out), "format": fmt, "files": files, "index": None if index is None else str(index), "skipped": skipped}


def register(app: typer.Typer) -> None:
    @app.command(
        "plot",
        help="Figures of a capture: magnitude heatmaps, per-channel profiles with outliers, histograms, an outlier map "
        "over layers, attention concentration curves and head importance. One layer/head by default; --all writes "
        "every selected layer and head plus an index.html.",
        epilog=example_epilog(
            "kvtool plot samples/smollm2-sample.safetensors --layer 15 --head 1 --out plots",
            "kvtool plot cap.safetensors --all --out plots --format svg",
            "kvtool plot cap.safetensors --what heatmap,profile --layer 7 --json",
        ),
    )
    @kvtool_command
    def plot(
        path: CaptureArg,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder for the figures (default: <capture name>-plots; created if missing).")] = None,
        fmt: Annotated[str, typer.Option("--format", help="png, svg or pdf.")] = "png",
        layer: Annotated[int | None, typer.Option("--layer", help="Layer for single plots (default: the middle captured layer).")] = None,
        head: Annotated[int | None, typer.Option("--head", help="KV head for single plots (default 0).")] = None,
        all_plots: Annotated[bool, typer.Option("--all", help="Every layer in --layers and KV head in --heads, plus index.html.")] = False,
        layers: Annotated[str | None, typer.Option("--layers", help="Layers for --all and for the outlier map, e.g. 0,5,10-12 (default: all captured).")] = None,
        heads: Annotated[str | None, typer.Option("--heads", help="KV heads for --all, e.g. 0,2 (default: all).")] = None,
        what: Annotated[str | None, typer.Option("--what", help=f"Plot kinds, comma separated: {', '.join(KINDS)} (default: all).")] = None,
        outlier_factor: Annotated[float, typer.Option("--outlier-factor", min=1.0, help="Outlier channel threshold: mean |x| >= this x median channel.")] = 4.0,
        queries: Annotated[int, typer.Option("--queries", min=1, help="Query positions sampled per sequence for attention plots.")] = 64,
        force: ForceOpt = False,
        json_out: JsonOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        settings = StatsSettings(outlier_factor=outlier_factor, max_queries=queries)
        result = make_plots(path, out, fmt, layer, head, all_plots, layers, heads, what, settings, force, quiet=json_out)
        if json_out:
            emit_json(result)
            return
        rows = [(f["kind"], f["layer"], f["head"], f["part"], f["path"]) for f in result["files"]]
        console.print(make_table(f"{len(rows)} figures in {result['out']}", ["what", "layer", "head", "part", "file"], rows))
        for s in result["skipped"]:
            console.print(f"skipped {s['kind']}: {s['reason']}")
        if result["index"]:
            console.print(f"open {result['index']} in a browser to scroll through them")
