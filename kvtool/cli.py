"""The ``kvtool`` command line: a thin Typer app over the library.

Each subcommand is one module in :mod:`kvtool.commands` with a ``register(app)`` function, an
``ORDER`` number (its place in ``--help``) and a one-line ``SHORT_HELP``. Modules are discovered, so adding a command is adding
a file. Command modules import the library inside their functions, so ``kvtool --help`` and
``kvtool --version`` never load torch.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Annotated, Any, Sequence

import click
import typer
from rich.text import Text
from typer.core import TyperGroup

from kvtool import commands
from kvtool._version import __version__
from kvtool.commands._common import (
    command_of,
    err_console,
    error_object,
    one_line,
    set_global_debug,
    set_global_quiet,
    set_no_color,
)
from kvtool.core import settings
from kvtool.core.jsonio import to_json_text

# Off a terminal rich's help would be 80 columns wide and cut the usage line; give it room (a value
# already in TERMINAL_WIDTH wins). Not unbounded: help panels fill the whole width. Set through the
# environment because typer.rich_utils, which reads it, loads only when help is printed.
HELP_WIDTH_OFF_TTY = 160
if not sys.stdout.isatty():
    os.environ.setdefault("TERMINAL_WIDTH", str(HELP_WIDTH_OFF_TTY))


def _bench_json_alias(argv: list[str]) -> list[str]:
    """``kvtool bench SUITE --json PATH`` (the old form) -> ``--json``-less ``-o PATH``, and
    ``--json -`` -> ``--json``; every other command line is returned unchanged."""
    if not argv or argv[0] != "bench" or "--json" not in argv:
        return argv
    i = argv.index("--json")
    nxt = argv[i + 1] if i + 1 < len(argv) else None
    if nxt == "-":
        err_console.print("note: `--json -` is deprecated; `--json` alone prints the JSON on stdout", style="yellow")
        return argv[:i] + ["--json"] + argv[i + 2:]
    if nxt is not None and not nxt.startswith("-"):
        err_console.print(f"note: `--json {nxt}` is deprecated; use `-o {nxt}` (and `--json` for JSON on stdout)", style="yellow")
        return argv[:i] + ["-o", nxt] + argv[i + 2:]
    return argv


# Options that take several values after one flag, the way `eval --formats a b` does (eval reads the
# words after its captures itself): in these commands, which take no positional argument after their
# options, `--formats a b` is `--formats a --formats b`.
MULTI_VALUE = {"bench": ("--formats",), "tasks": ("--methods", "-M")}


def _multi_values(argv: list[str]) -> list[str]:
    """``kvtool bench decode --formats a b --plan p.json`` -> ``... --formats a --formats b --plan p.json``
    for the options of :data:`MULTI_VALUE`; every other command line is returned unchanged."""
    at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if at is None or argv[at] not in MULTI_VALUE:
        return argv
    flags = MULTI_VALUE[argv[at]]
    out, flag, taken = argv[: at + 1], None, False
    for word in argv[at + 1:]:
        if word == "--":
            flag = None
        elif word.startswith("-"):
            name = word.partition("=")[0]
            flag, taken = (name, "=" in word) if name in flags else (None, False)
        elif flag is not None:
            if taken:
                out.append(flag)
            taken = True
        out.append(word)
    return out


class KvtoolGroup(TyperGroup):
    """The root group: a usage error Click finds (a bad option value, a missing argument) is one
    ``error:`` line on stderr like every other error, and with ``--json`` on the command line also
    one ``{"error": ...}`` object on stdout."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = _multi_values(_bench_json_alias(list(args) if args is not None else sys.argv[1:]))
        if not standalone_mode:
            return super().main(args=argv, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args=argv, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            message = one_line(exc.format_message())
            if "--json" in argv:
                sys.stdout.write(to_json_text(error_object("UsageError", message, exc.exit_code, command_of(ctx))))
                sys.stdout.flush()
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None and exc.exit_code == 2 else ""
            err_console.print(Text.assemble(("error:", "red"), f" {message}{hint}"))
            sys.exit(exc.exit_code)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:  # Ctrl-C before a command ran (while its modules load)
            if "--json" in argv:
                sys.stdout.write(to_json_text(error_object("Interrupted", "interrupted (Ctrl-C)", 130, None)))
                sys.stdout.flush()
            err_console.print("interrupted")
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="kvtool",
    cls=KvtoolGroup,
    help="Offline KV-cache toolkit: capture real caches, analyse them, compress them with the formats "
    "of five papers, verify fidelity and benchmark the GPU kernels.\n\n"
    "Start with: kvtool capture -o cap.safetensors  (embedded SmolLM2-135M, built-in prompt), or try any "
    "command on the bundled sample capture: kvtool stats sample:",
    no_args_is_help=True,
    add_completion=True,
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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output on stderr, for every command.")] = False,
    no_color: Annotated[bool, typer.Option("--no-color", help="Plain text without colours (NO_COLOR=1 does the same).")] = False,
    no_verify_checksums: Annotated[bool, typer.Option("--no-verify-checksums", help="Skip the per-tensor checksums when reading files (faster; corruption then goes unnoticed). Same as KVTOOL_NO_VERIFY_CHECKSUMS=1.")] = False,
    allow_nonfinite: Annotated[bool, typer.Option("--allow-nonfinite", help="Accept captures and compressed files holding NaN or infinite values (refused by default). Same as KVTOOL_ALLOW_NONFINITE=1.")] = False,
) -> None:
    set_global_debug(debug)
    set_global_quiet(quiet)
    set_no_color(no_color)
    # a settings module the readers consult, so that start-up does not import the library
    settings.verify_checksums = not no_verify_checksums
    settings.allow_nonfinite = allow_nonfinite


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
