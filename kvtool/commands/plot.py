"""``kvtool plot``: figures of a capture (see :mod:`kvtool.analysis.plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.core.errors import UsageError
from kvtool.commands._common import (
    CaptureArg,
    DebugOpt,
    ForceOpt,
    JsonOpt,
    QuietOpt,
    console,
    deprecated,
    emit_json,
    example_epilog,
    kvtool_command,
    make_table,
    library_progress,
    show,
)

ORDER = 35
SHORT_HELP = "Heatmaps, channel profiles, histograms, attention and head figures"

# kvtool.analysis.plots.KINDS and the image types kvtool.analysis.file_drivers.plot_file writes, named
# here so that --help needs no torch or matplotlib (tests/test_cli.py checks they agree)
KIND_NAMES = ("heatmap", "profile", "histogram", "outliers", "concentration", "heads")
IMAGE_TYPES = ("png", "svg", "pdf")


def register(app: typer.Typer) -> None:
    @app.command(
        "plot",
        help="Figures of a capture: magnitude heatmaps, per-channel profiles with outliers, histograms, an outlier map "
        "over layers, attention concentration curves and head importance. One layer/head by default; --all writes "
        "every selected layer and head plus an index.html.",
        epilog=example_epilog(
            "kvtool plot sample: --layer 15 --head 1 --out-dir plots",
            "kvtool plot cap.safetensors --all --out-dir plots --image-type svg",
            "kvtool plot cap.safetensors --what heatmap,profile --layer 7 --json",
        ),
    )
    @kvtool_command
    def plot(
        path: CaptureArg,
        out: Annotated[Path | None, typer.Option("--out-dir", help="Folder for the figures (default: <capture name>-plots; created if missing).")] = None,
        out_old: Annotated[Path | None, typer.Option("--out", "-o", hidden=True, help="Deprecated name of --out-dir.")] = None,
        fmt: Annotated[str, typer.Option("--image-type", help="png, svg or pdf.")] = "png",
        fmt_old: Annotated[str | None, typer.Option("--format", hidden=True, help="Deprecated name of --image-type.")] = None,
        layer: Annotated[int | None, typer.Option("--layer", help="Layer for single plots (default: the middle captured layer).")] = None,
        head: Annotated[int | None, typer.Option("--head", help="KV head for single plots (default 0).")] = None,
        all_plots: Annotated[bool, typer.Option("--all", help="Every layer in --layers and KV head in --heads, plus index.html.")] = False,
        layers: Annotated[str | None, typer.Option("--layers", help="Layers for --all and for the outlier map, e.g. 0,5,10-12 (default: all captured).")] = None,
        heads: Annotated[str | None, typer.Option("--heads", help="KV heads for --all, e.g. 0,2 (default: all).")] = None,
        what: Annotated[str | None, typer.Option("--what", help=f"Plot kinds, comma separated: {', '.join(KIND_NAMES)} (default: all).")] = None,
        outlier_factor: Annotated[float, typer.Option("--outlier-factor", min=1.0, help="Outlier channel threshold: mean |x| >= this x median channel.")] = 4.0,
        queries: Annotated[int, typer.Option("--queries", min=1, help="Query positions sampled per sequence for attention plots.")] = 64,
        force: ForceOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        from kvtool.analysis.file_drivers import plot_file  # deferred: start-up time
        from kvtool.analysis.stats import StatsSettings  # deferred: start-up time

        if out_old is not None:
            deprecated("--out/-o", "--out-dir")
            out = out or out_old
        option = "--image-type"
        if fmt_old is not None:
            deprecated("--format", "--image-type")
            fmt, option = fmt_old, "--format"
        if fmt not in IMAGE_TYPES:
            raise UsageError(f"unknown {option} {fmt!r}: choose one of {', '.join(IMAGE_TYPES)}")
        settings = StatsSettings(outlier_factor=outlier_factor, max_queries=queries)
        with library_progress(json_out) as progress:
            result = plot_file(path, out, fmt, layer, head, all_plots, layers, heads, what, settings, force, progress=progress)
        if json_out:
            emit_json(result, input=path, output=result["out"])
            return
        rows = [(f["kind"], f["layer"], f["head"], f["part"], f["path"]) for f in result["files"]]
        console.print(make_table(f"{len(rows)} figures in {result['out']}", ["what", "layer", "head", "part", "file"], rows))
        for skipped in result["skipped"]:
            show("skipped {}: {}", skipped["kind"], skipped["reason"])
        if result["index"]:
            show("open {} in a browser to scroll through them", result["index"])
