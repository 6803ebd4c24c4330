"""``kvtool plot``: figures of a capture (see :mod:`kvtool.analysis.plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.core.errors import UsageError
from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import (
    CaptureArg,
    ForceOpt,
    console,
    deprecated,
    example_epilog,
    make_table,
    show,
)
from kvtool.core.progress import Progress

ORDER = 35
SHORT_HELP = "Heatmaps, channel profiles, histograms, attention and head figures"

# kvtool.analysis.plots.KINDS and the image types kvtool.analysis.file_drivers.plot_file writes, named
# here so that --help needs no torch or matplotlib (tests/test_cli.py checks they agree)
KIND_NAMES = ("heatmap", "profile", "histogram", "outliers", "concentration", "heads")
IMAGE_TYPES = ("png", "svg", "pdf")


def print_plots(outcome: Outcome) -> None:
    result = outcome.data
    rows = [(f["kind"], f["layer"], f["head"], f["part"], f["path"]) for f in result["files"]]
    console.print(make_table(f"{len(rows)} figures in {outcome.output}", ["what", "layer", "head", "part", "file"], rows))
    for skipped in result["skipped"]:
        show("skipped {}: {}", skipped["kind"], skipped["reason"])
    if result["index"]:
        show("open {} in a browser to scroll through them", result["index"])


@declare(
    "plot",
    help="Figures of a capture: magnitude heatmaps, per-channel profiles with outliers, histograms, an outlier map "
    "over layers, attention concentration curves and head importance. One layer/head by default; --all writes "
    "every selected layer and head plus an index.html.",
    epilog=example_epilog(
        "kvtool plot sample: --layer 15 --head 1 --out-dir plots",
        "kvtool plot cap.safetensors --all --out-dir plots --image-type svg",
        "kvtool plot cap.safetensors --what heatmap,profile --layer 7 --json",
    ),
    render=print_plots,
)
def plot(
    capture: CaptureArg,
    out_dir: Annotated[Path | None, typer.Option("--out-dir", help="Folder for the figures (default: <capture name>-plots; created if missing).")] = None,
    out_old: Annotated[Path | None, typer.Option("--out", "-o", hidden=True, help="Deprecated name of --out-dir.")] = None,
    image_type: Annotated[str, typer.Option("--image-type", help="png, svg or pdf.")] = "png",
    image_type_old: Annotated[str | None, typer.Option("--format", hidden=True, help="Deprecated name of --image-type.")] = None,
    layer: Annotated[int | None, typer.Option("--layer", help="Layer for single plots (default: the middle captured layer).")] = None,
    head: Annotated[int | None, typer.Option("--head", help="KV head for single plots (default 0).")] = None,
    all_plots: Annotated[bool, typer.Option("--all", help="Every layer in --layers and KV head in --heads, plus index.html.")] = False,
    layers: Annotated[str | None, typer.Option("--layers", help="Layers for --all and for the outlier map, e.g. 0,5,10-12 (default: all captured).")] = None,
    heads: Annotated[str | None, typer.Option("--heads", help="KV heads for --all, e.g. 0,2 (default: all).")] = None,
    what: Annotated[str | None, typer.Option("--what", help=f"Plot kinds, comma separated: {', '.join(KIND_NAMES)} (default: all).")] = None,
    outlier_factor: Annotated[float, typer.Option("--outlier-factor", min=1.0, help="Outlier channel threshold: mean |x| >= this x median channel.")] = 4.0,
    queries: Annotated[int, typer.Option("--queries", min=1, help="Query positions sampled per sequence for attention plots.")] = 64,
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis.file_drivers import plot_file  # deferred: start-up time
    from kvtool.analysis.stats import StatsSettings  # deferred: start-up time

    if out_old is not None:
        deprecated("--out/-o", "--out-dir")
        out_dir = out_dir or out_old
    option = "--image-type"
    if image_type_old is not None:
        deprecated("--format", "--image-type")
        image_type, option = image_type_old, "--format"
    if image_type not in IMAGE_TYPES:
        raise UsageError(f"unknown {option} {image_type!r}: choose one of {', '.join(IMAGE_TYPES)}")
    settings = StatsSettings(outlier_factor=outlier_factor, max_queries=queries)
    result = plot_file(capture, out_dir, image_type, layer, head, all_plots, layers, heads, what, settings, force, progress=progress)
    folder = result.pop("out")  # the envelope's output
    result["image_type"] = result.pop("format")
    return Outcome(result, input=capture, output=folder)

def register(app: typer.Typer) -> None:
    add_commands(app, plot)
