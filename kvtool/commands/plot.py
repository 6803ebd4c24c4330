"""``kvtool plot``: figures of a capture (see :mod:`kvtool.analysis.plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.analysis.plots import KINDS
from kvtool.analysis.stats import StatsSettings
from kvtool.analysis.reports import plot_file
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
    library_progress,
)

ORDER = 35
SHORT_HELP = "Heatmaps, channel profiles, histograms, attention and head figures"


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
        with library_progress(json_out) as progress:
            result = plot_file(path, out, fmt, layer, head, all_plots, layers, heads, what, settings, force, progress=progress)
        if json_out:
            emit_json(result)
            return
        rows = [(f["kind"], f["layer"], f["head"], f["part"], f["path"]) for f in result["files"]]
        console.print(make_table(f"{len(rows)} figures in {result['out']}", ["what", "layer", "head", "part", "file"], rows))
        for s in result["skipped"]:
            console.print(f"skipped {s['kind']}: {s['reason']}")
        if result["index"]:
            console.print(f"open {result['index']} in a browser to scroll through them")
