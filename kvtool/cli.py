"""The ``kvtool`` command line: a thin Typer app over the library.

Each subcommand is one module in :mod:`kvtool.commands` with a ``register(app)`` function, an
``ORDER`` number (its place in ``--help``) and a one-line ``SHORT_HELP``. Modules are discovered, so adding a command is adding
a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Annotated

import typer

from kvtool import commands
from kvtool._version import __version__
from kvtool.commands._common import set_global_debug
from kvtool.core import io

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
    no_verify_checksums: Annotated[bool, typer.Option("--no-verify-checksums", help="Skip the per-tensor checksums when reading files (faster; corruption then goes unnoticed). Same as KVTOOL_NO_VERIFY_CHECKSUMS=1.")] = False,
    allow_nonfinite: Annotated[bool, typer.Option("--allow-nonfinite", help="Accept captures and compressed files holding NaN or infinite values (refused by default). Same as KVTOOL_ALLOW_NONFINITE=1.")] = False,
) -> None:
    set_global_debug(debug)
    io.set_verify_checksums(not no_verify_checksums)
    io.set_allow_nonfinite(allow_nonfinite)


def _discover() -> None:
    mods = []
    for info in pkgutil.iter_modules(commands.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(mod, "register"):
            mods.append(mod)
    modules = {}
    for mod in sorted(mods, key=lambda m: (getattr(m, "ORDER", 100), m.__name__)):
        before = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
        mod.register(app)
        after = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
        for name in after - before:
            modules[name] = mod
    # `kvtool --help` lists each command on one line
    for info in app.registered_commands + app.registered_groups:
        name = info.name or (info.typer_instance.info.name if getattr(info, "typer_instance", None) else None)
        if not info.short_help and getattr(modules.get(name), "SHORT_HELP", None):
            info.short_help = modules[name].SHORT_HELP
        elif not info.short_help:
            text = info.help or (info.callback.__doc__ if info.callback else None) or ""
            first = text.strip().split("\n\n")[0].replace("\n", " ")
            info.short_help = first.split(". ")[0].split(": ")[0].split("; ")[0].rstrip(".")


_discover()


def main() -> None:
    app()
