"""Shared pieces of the CLI: option types, error handling, output (rich or JSON), progress.

Every command module defines ``register(app)`` and decorates its function with
:func:`kvtool_command`, which turns :class:`~kvtool.core.errors.KvtoolError` into one ``error:`` line and
its exit code (1 bad data, 2 bad usage), and any other exception into one line too unless
``--debug`` is given (then the traceback is shown).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path
from contextlib import contextmanager
from typing import Annotated, Any, Callable, Iterable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtool.core.progress import Progress as LibraryProgress
from kvtool.core.jsonio import to_json_text
from kvtool.core.errors import KvtoolError

console = Console(stderr=False, highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

# --------------------------------------------------------------------------- shared option types

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the full traceback when something fails.")]
ForceOpt = Annotated[bool, typer.Option("--force", "-f", help="Overwrite the output if it exists.")]
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Output file.", dir_okay=False)]
InputArg = Annotated[Path, typer.Argument(help="A kvtool file (capture or compressed).", show_default=False)]
CaptureArg = Annotated[Path, typer.Argument(help="A capture file made by `kvtool capture`.", show_default=False)]
LayersOpt = Annotated[str | None, typer.Option("--layers", help="Layers to use, e.g. 0,5,10-12 (default: all).")]
HeadsOpt = Annotated[str | None, typer.Option("--heads", help="KV heads to use, e.g. 0,2 (default: all).")]

_global_debug = False


def set_global_debug(value: bool) -> None:
    global _global_debug
    _global_debug = value


def debug_enabled(local: bool = False) -> bool:
    return local or _global_debug or os.environ.get("KVTOOL_DEBUG", "") not in ("", "0")


def kvtool_command(fn: Callable) -> Callable:
    """Wrap a command: KvtoolError -> ``error: msg`` + its exit code; other exceptions -> one line
    and exit 1, or the traceback with --debug; Ctrl-C -> exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = debug_enabled(bool(kwargs.get("debug", False)))
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KvtoolError as exc:
            if debug:
                err_console.print_exception()
            err_console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug or an environment problem: still one line by default
            if debug:
                err_console.print_exception()
            err_console.print(f"[red]error:[/red] {type(exc).__name__}: {exc} (run with --debug for the traceback)")
            raise typer.Exit(1) from None

    return wrapper


def example_epilog(*examples: str) -> str:
    """Help epilog with examples (shown by --help)."""
    lines = "\n\n".join(f"  $ {e}" for e in examples)
    return f"Examples:\n\n{lines}"


# --------------------------------------------------------------------------- output


def emit_json(data: Any) -> None:
    """Print ``data`` as JSON on stdout (NaN/inf become null)."""
    sys.stdout.write(to_json_text(data))
    sys.stdout.flush()


def make_table(title: str | None, columns: Iterable[str], rows: Iterable[Iterable[Any]]) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for c in columns:
        table.add_column(c, justify="left" if c in ("name", "tensor", "part", "format", "parameters", "layer", "what", "value", "kernel", "provider") else "right")
    for r in rows:
        table.add_row(*[fmt_value(v) for v in r])
    return table


def fmt_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


class BarProgress(LibraryProgress):
    """The CLI's :class:`kvtool.core.progress.Progress`: each stage is a task of a rich bar, which
    starts with the first stage (a command that fails before any stage prints nothing)."""

    def __init__(self, bar: Progress):
        self.bar = bar
        self.task = None
        self.started = False

    def stage(self, what: str, total: int | None = None) -> None:
        if not self.started:
            self.bar.start()
            self.started = True
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(what, total=total)

    def advance(self, units: int = 1) -> None:
        if self.task is not None:
            self.bar.advance(self.task, units)

    def note(self, text: str) -> None:
        if not self.bar.disable:
            self.bar.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        if self.started:
            self.bar.stop()


@contextmanager
def library_progress(quiet: bool = False) -> Iterator[BarProgress]:
    """A progress sink for a library call, drawn as :func:`progress_bar` draws."""
    sink = BarProgress(progress_bar(quiet))
    try:
        yield sink
    finally:
        sink.close()


def progress_bar(quiet: bool = False) -> Progress:
    """A rich progress bar on stderr (hidden with --json so stdout stays clean JSON)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=quiet,
    )
