"""The ``kvtool`` command line: a thin Typer app over the library.

Each subcommand is one module in :mod:`kvtool.commands` with a ``register(app)`` function and an
``ORDER`` number (its place in ``--help``). Modules are discovered, so adding a command is adding
a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Annotated

import typer

from . import commands
from ._version import __version__
from .commands._common import set_global_debug

app = typer.Typer(
    name="kvtool",
    help="Offline KV-cache toolkit: capture real caches, analyse them, compress them with the formats "
    "of five papers, verify fidelity and benchmark the GPU kernels.\n\n"
    "Start with: kvtool capture -o cap.safetensors  (embedded SmolLM2-135M, built-in prompt)",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kvtool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for every command.")] = False,
) -> None:
    set_global_debug(debug)


SHORT_HELP = {
    "capture": "Run a model on a prompt; save keys, values, queries per layer",
    "info": "Show what a kvtool file holds: schema, model facts, tensors, bytes",
    "stats": "Magnitudes, outlier channels, sign entropy, attention concentration",
    "plot": "Heatmaps, channel profiles, histograms, attention and head figures",
    "prune": "Prune keys/values to an exact sparsity (Mustafar, ThinK, 2:4)",
    "compress": "Encode a capture with a format: bitmap, signvq, pagestat, snapstream, quant",
    "decompress": "Decode a compressed file back to a dense capture",
    "heads": "Attention-head selection: oracle error curve and trained routers",
    "verify": "Fidelity of a compressed file: attention error, recall, model NLL",
    "eval": "Sweep formats and parameters; fidelity vs bytes frontier",
    "recommend": "A compression plan per layer / KV head for a byte budget",
    "report": "One self-contained HTML report: cache, frontier, plans, kernels",
    "export": "Export to transformers caches, paged layouts, numpy, tables",
    "generate": "Continue generation from a saved or compressed cache",
    "bench": "Time the GPU kernels against cuBLAS and FlashInfer",
}


def _discover() -> None:
    mods = []
    for info in pkgutil.iter_modules(commands.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(mod, "register"):
            mods.append(mod)
    for mod in sorted(mods, key=lambda m: (getattr(m, "ORDER", 100), m.__name__)):
        mod.register(app)
    # `kvtool --help` lists each command on one line
    for info in app.registered_commands + app.registered_groups:
        name = info.name or (info.typer_instance.info.name if getattr(info, "typer_instance", None) else None)
        if name in SHORT_HELP:
            info.short_help = SHORT_HELP[name]
        elif not info.short_help:
            text = info.help or (info.callback.__doc__ if info.callback else None) or ""
            first = text.strip().split("\n\n")[0].replace("\n", " ")
            info.short_help = first.split(". ")[0].split(": ")[0].split("; ")[0].rstrip(".")


_discover()


def main() -> None:
    app()
