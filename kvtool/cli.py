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


_discover()


def main() -> None:
    app()
