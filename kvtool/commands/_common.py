"""Shared pieces of the CLI: option types, error handling, output (rich or JSON), progress.

Every command module defines ``register(app)`` and decorates its function with
:func:`kvtool_command`, which turns :class:`~kvtool.core.errors.KvtoolError` into one ``error:`` line and
its exit code (1 bad data, 2 bad usage), and any other exception into one line too unless
``--debug`` is given (then the traceback is shown). With ``--json`` a failure also prints one
``{"error": {...}}`` object on stdout (the contract is in docs/cli.md).

Rendering rule, the same for every command: on a terminal, rich tables fitted to its width; anywhere
else (a pipe, a CI log) the same tables on a console so wide that no value or header is ever cut.
Every piece of data is escaped before rich sees it, so ``[red]`` in a path prints literally.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvtool._version import __version__
from kvtool.commands._complete import complete_model
from kvtool.core import outputs, settings
from kvtool.commands._complete import complete_device
from kvtool.core.errors import KvtoolError
from kvtool.core.limits import MAX_PAGE_SIZE, MAX_TOKENS, bounded_int
from kvtool.core.jsonio import envelope, to_json_text
from kvtool.core.progress import BarProgress, LineProgress, stage_callback  # noqa: F401 (re-exported for commands)
from kvtool.core.progress import Progress as LibraryProgress
from kvtool.core.sample import resolve_sample

# Off a terminal rich would wrap and cut at 80 columns; this width means "never cut".
LOG_WIDTH = 100_000
# Off a terminal a long stage reports at least this often (seconds).
HEARTBEAT_S = 10.0


def _make_console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=None if tty else LOG_WIDTH)


console = _make_console(stderr=False)
err_console = _make_console(stderr=True)

# --------------------------------------------------------------------------- shared option types


@dataclass(frozen=True)
class Api:
    """How the Python API (:mod:`kvtool.api`) shows a declared parameter, given as one more item of
    its ``Annotated``: ``skip`` leaves a CLI-only parameter out, ``positional`` lets an option be
    passed by position, ``type`` widens the annotation the API shows (see
    :mod:`kvtool.commands._command`)."""

    skip: bool = False
    positional: bool = False
    type: Any = None


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables (see docs/cli.md).")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the full traceback when something fails.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")]
ForceOpt = Annotated[bool, typer.Option("--force", "-f", help="Overwrite the output if it exists.")]
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Output file.", dir_okay=False)]
InputArg = Annotated[Path, typer.Argument(help="A kvtool file (capture or compressed), or 'sample:' for the bundled sample.", show_default=False)]
CaptureArg = Annotated[Path, typer.Argument(help="A capture file made by `kvtool capture`, or 'sample:' for the bundled sample.", show_default=False)]
LayersOpt = Annotated[str | None, typer.Option("--layers", help="Layers to use, e.g. 0,5,10-12 (default: all).")]
HeadsOpt = Annotated[str | None, typer.Option("--heads", help="KV heads to use, e.g. 0,2 (default: all).")]
# --model / --no-model of the commands that run the model; in the Python API ``model=False`` is --no-model
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Model: 'embedded', a local HF folder or a .gguf file (default: the embedded one when the capture came from it; --no-model: none).", autocompletion=complete_model),
                     Api(type=str | bool | None)]
NoModelOpt = Annotated[bool, typer.Option("--no-model", help="Do not run the model (attention-level results only; much faster)."), Api(skip=True)]


def model_choice(model: Any, no_model: bool) -> tuple[Any, bool]:
    """(the model to use or None for the default, whether to run one): ``--no-model`` or, from
    Python, ``model=False`` means none."""
    if no_model or model is False:
        return None, False
    return model, True

class Number(click.ParamType):
    """A float option whose bad value reads ``--max-error must be a number, got 'abc'``."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            return float(value)
        except (TypeError, ValueError):
            opt = param.opts[0] if param is not None and param.opts else "the value"
            self.fail(f"{opt} must be a number, got {value!r}", param, ctx)


NUMBER = Number()

_global = {"debug": False, "quiet": False}
# what the running command is: its name for the JSON envelope, whether it prints JSON, is quiet
_current: dict[str, Any] = {"command": None, "json": False, "quiet": False, "debug": False}


def set_global_debug(value: bool) -> None:
    _global["debug"] = value


def set_global_quiet(value: bool) -> None:
    _global["quiet"] = value


def set_no_color(value: bool) -> None:
    """``--no-color`` (NO_COLOR in the environment is honoured by rich itself)."""
    if value:
        console.no_color = True
        err_console.no_color = True


def debug_enabled(local: bool = False) -> bool:
    return local or _global["debug"] or _current.get("debug", False) or os.environ.get("KVTOOL_DEBUG", "") not in ("", "0")


def quiet_enabled(local: bool = False) -> bool:
    return local or _global["quiet"] or _current["quiet"]


def _command_name() -> str | None:
    """``compress`` or ``bench dense``: the path below the root of the running click command."""
    return command_of(click.get_current_context(silent=True))


def command_of(ctx: click.Context | None) -> str | None:
    """``compress`` or ``bench dense``: the names below the root of ``ctx``'s command."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(reversed(names)) or None


def error_object(exc_type: str, message: str, exit_code: int, command: str | None = None) -> dict[str, Any]:
    """The JSON a failing ``--json`` command prints on stdout."""
    return {"kvtool_version": __version__, "command": command or _current["command"] or _command_name(),
            "error": {"type": exc_type, "message": message, "exit_code": exit_code}}


_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b.")
MAX_MESSAGE = 2000


def one_line(text: str, first_line_only: bool = False) -> str:
    """``text`` as one printable line: terminal escapes (colours, titles) removed, other control
    characters shown as ``?``, the lines joined (or only the first kept: a foreign error's first
    line says what failed, the rest are frames), at most MAX_MESSAGE characters."""
    lines = [" ".join(line.split()) for line in _ESCAPES.sub("", str(text)).splitlines()]
    lines = [line for line in lines if line]
    out = (lines[0] if first_line_only else " ".join(lines)) if lines else ""
    out = "".join(ch if ch.isprintable() else "?" for ch in out)
    return out if len(out) <= MAX_MESSAGE else out[: MAX_MESSAGE - 3] + "..."


# the error types a failing --json command reports (docs/cli.md and the JSON schema list them)
ERROR_TYPES = ("BadDataError", "UsageError", "InternalError", "Interrupted")


def error_type(exc: KvtoolError) -> str:
    """The documented type of a kvtool error: its exit code says which (a subclass such as
    OutputExistsError is reported as the UsageError it is)."""
    return "UsageError" if exc.exit_code == 2 else "BadDataError"


def _fail(exc_type: str, message: str, exit_code: int, json_mode: bool) -> None:
    message = one_line(message)
    if json_mode:
        sys.stdout.write(to_json_text(error_object(exc_type, message, exit_code)))
        sys.stdout.flush()
    err_console.print(Text.assemble(("error:", "red"), " ", message))
    raise typer.Exit(exit_code)


def kvtool_command(fn: Callable) -> Callable:
    """Wrap a command: KvtoolError -> ``error: msg`` + its exit code; other exceptions -> one line
    and exit 1, or the traceback with --debug; Ctrl-C -> exit 130. With ``--json`` (a ``json_out``
    flag) the failure is also one ``{"error": ...}`` object on stdout."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _current["debug"] = False  # not the previous command's --debug
        debug = debug_enabled(bool(kwargs.get("debug", False)))
        json_mode = kwargs.get("json_out") is True
        _current.update(command=_command_name(), json=json_mode, quiet=bool(kwargs.get("quiet", False)) or _global["quiet"], debug=debug)
        settings.notes = not (json_mode or _current["quiet"])  # the library's one-off stderr notes
        try:
            with outputs.command_inputs():
                return fn(*args, **declare_files(kwargs))
        except typer.Exit:
            raise
        except click.ClickException as exc:  # a parameter checked inside the command
            _fail("UsageError", exc.format_message(), exc.exit_code, json_mode)
        except KvtoolError as exc:
            if debug:
                err_console.print_exception()
            _fail(error_type(exc), str(exc), exc.exit_code, json_mode)
        except KeyboardInterrupt:
            if json_mode:  # a script parsing stdout still gets its one object
                sys.stdout.write(to_json_text(error_object("Interrupted", "interrupted (Ctrl-C)", 130)))
                sys.stdout.flush()
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug or an environment problem: still one line by default
            if debug:
                err_console.print_exception()
            # the first line of a foreign error (torch's C++ frames, a library's coloured log follow it)
            what = one_line(str(exc), first_line_only=True) or "no message"
            _fail("InternalError", f"{type(exc).__name__}: {what} (run with --debug for the traceback)", 1, json_mode)

    return wrapper


# the parameters (in every command) that name files or folders the command writes; every other path
# argument is an input, which no output may be (tests/test_outputs.py checks every command's options)
OUTPUT_PARAMS = frozenset({"output", "out", "out_old", "out_dir", "plot", "plot_old", "plot_output", "router_out", "router_out_old"})
# the parameters naming a folder every file of which is an input (a model folder: its weights, config, tokenizer)
FOLDER_INPUTS = frozenset({"model"})


# integer options bounded tighter than the one rule (docs/cli.md: at most 2^24 in size); seeds are any 64-bit integer
INT_LIMITS = {"threads": (1, 1 << 10), "page_size": (1, MAX_PAGE_SIZE)}
SEED_LIMIT = (-(1 << 63), (1 << 63) - 1)


def check_integers(kwargs: dict[str, Any]) -> None:
    """Every integer argument (and every integer in a list argument) within the one size rule: at
    most :data:`kvtool.core.limits.MAX_TOKENS` in size (``--threads`` 1 to 1024, ``--page-size`` 1 to 4096, a seed any 64-bit
    integer), a UsageError naming the option otherwise, before any work (no OverflowError from
    torch, no run that takes forever)."""
    for key, value in kwargs.items():
        low, high = INT_LIMITS.get(key, SEED_LIMIT if key.endswith("seed") else (-MAX_TOKENS, MAX_TOKENS))
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and not isinstance(item, bool):
                bounded_int("--" + key.replace("_", "-"), item, low, high)


def declare_files(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The command's arguments with ``sample:`` resolved, after recording every path argument that is
    not an output as an input of the command (:func:`kvtool.core.outputs.note_input`) and checking
    that no output is ``sample:`` or one of those inputs: the one output check then knows every input
    before any work starts, and refuses the same again when the file is written. Integer arguments
    are bounded first (:func:`check_integers`): the CLI and the Python API both pass through here."""
    check_integers(kwargs)
    resolved = {}
    for key, value in kwargs.items():
        items = value if isinstance(value, list) else [value]
        if key in OUTPUT_PARAMS:
            resolved[key] = value
            continue
        items = [resolve_sample(x) for x in items]
        for item in items:
            outputs.note_input(item, folder=key in FOLDER_INPUTS)
        resolved[key] = items if isinstance(value, list) else items[0]
    for key in OUTPUT_PARAMS & kwargs.keys():
        if kwargs[key] is not None:
            outputs.refuse_input(kwargs[key])
    return resolved


def example_epilog(*examples: str) -> str:
    """Help epilog with examples (shown by --help; escaped so ``[...]`` in an example prints)."""
    lines = "\n\n".join(f"  $ {escape(e)}" for e in examples)
    return f"Examples:\n\n{lines}"


def deprecated(old: str, new: str) -> None:
    """One stderr line: option ``old`` still works but is renamed ``new`` (not with --json, whose
    stderr stays free for errors)."""
    if _current["json"]:
        return
    err_console.print(Text(f"note: {old} is deprecated; use {new}", style="yellow"))


# --------------------------------------------------------------------------- output


def emit_json(data: dict[str, Any], *, input: Any = None, inputs: Iterable[Any] | None = None, output: Any = None) -> None:
    """Print ``data`` as one JSON object on stdout, led by the contract's keys (docs/cli.md):
    ``kvtool_version``, ``command``, ``input`` or ``inputs``, and ``output`` when a file or folder
    was written. NaN/inf become null."""
    obj = envelope(_current["command"] or _command_name(), data, input=input, inputs=inputs, output=output)
    sys.stdout.write(to_json_text(obj))
    sys.stdout.flush()


def show(text: str, *data: Any) -> None:
    """Print a line to stdout: ``text`` is rich markup with ``{}`` slots, filled with ``data``
    escaped (so values print literally whatever brackets they hold)."""
    console.print(text.format(*(escape(str(d)) for d in data)))


def params_text(params: dict[str, Any]) -> str:
    """A format's parameters for a header: unset (None) ones left out, and a ratio that a fixed value
    overrides said to be unused (``budget=256; budget_ratio unused: budget applies``)."""
    shown = {k: v for k, v in params.items() if v is not None}
    notes = []
    for fixed in ("budget",):
        if fixed in shown and f"{fixed}_ratio" in shown:
            shown.pop(f"{fixed}_ratio")
            notes.append(f"{fixed}_ratio unused: {fixed} applies")
    text = ", ".join(f"{k}={v}" for k, v in shown.items()) or "defaults"
    return "; ".join([text, *notes])


LEFT_COLUMNS = ("name", "tensor", "dtype", "shape", "part", "format", "parameters", "layer", "what", "value", "kernel", "provider", "capture", "variant", "file", "channels", "why", "q heads")


def make_table(title: str | None, columns: Iterable[str], rows: Iterable[Iterable[Any]]) -> Table:
    """A rich table whose title, headers and cells are all literal text (never markup)."""
    table = Table(title=Text(title) if title else None, title_justify="left", header_style="bold")
    for c in columns:
        table.add_column(Text(c), justify="left" if c in LEFT_COLUMNS else "right", overflow="fold")
    for r in rows:
        table.add_row(*[v if isinstance(v, Text) else Text(fmt_value(v)) for v in r])
    return table


def fmt_value(v: Any) -> str:
    """A table cell: floats with 4 decimals (docs/cli.md), in scientific notation below 0.0001 or
    from a million up; None as ``-``; booleans as yes/no."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-4 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


# how a fidelity number's band (kvtool.analysis.bands) is shown: colour on a terminal; the verdict
# lines say it in words, for logs and NO_COLOR
GRADE_STYLE = {"good": "green", "fair": "yellow", "poor": "bold red", "noise": "dim"}


def graded(metric: str, value: Any, text: str | None = None) -> Text:
    """A table cell for a fidelity metric, coloured by its band (good/fair/poor; a negative NLL
    increase dim, as noise)."""
    from kvtool.analysis.bands import grade  # deferred: only tables of fidelity numbers need it

    return Text(text if text is not None else fmt_value(value), style=GRADE_STYLE.get(grade(metric, value) or "", ""))


def verdict(values: dict[str, Any]) -> str | None:
    """One line that reads the numbers: ``reading: rel L2 0.3340 fair, cosine 0.9329 poor, ...``
    (the bands are in docs/fidelity.md, section Reading the numbers)."""
    from kvtool.analysis.bands import BANDS, grade  # deferred: only tables of fidelity numbers need it

    parts = [f"{BANDS[m].label} {fmt_value(v)} {grade(m, v)}" for m, v in values.items() if v is not None and grade(m, v)]
    return ("reading: " + ", ".join(parts)) if parts else None


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"



# --------------------------------------------------------------------------- progress


def _progress_enabled(quiet: bool) -> bool:
    """Progress is off with -q, and with --json unless KVTOOL_PROGRESS=1 (stdout stays one JSON
    object and stderr stays free for errors, which scripts that merge the two streams rely on)."""
    if quiet_enabled(quiet):
        return False
    if _current["json"]:
        return os.environ.get("KVTOOL_PROGRESS", "") not in ("", "0")
    return True


@contextmanager
def library_progress(quiet: bool = False) -> Iterator[LibraryProgress]:
    """The progress sink every library call of the CLI gets (:mod:`kvtool.core.progress`): a rich bar
    on a terminal, plain lines with rate and time left on stderr elsewhere, nothing with ``-q`` (or
    ``quiet``; ``--json`` passes itself here too)."""
    if not _progress_enabled(quiet):
        sink: LibraryProgress = LibraryProgress()
    elif err_console.is_terminal:
        sink = BarProgress(err_console)
    else:
        sink = LineProgress(_current["command"] or _command_name(), heartbeat=HEARTBEAT_S)
    try:
        yield sink
    except BaseException:
        sink.close(failed=True)
        raise
    sink.close()


# the --device option of the commands that compute (kept here, not in the library, so help needs no torch)
DEVICE_HELP = "Where to compute: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N."
DEVICES_HELP = ("Where layers are computed: auto (default: every visible GPU, layers spread over them and worked on at once; "
                "the CPU without one), cpu, cuda, cuda:1, or a list such as cuda:0,cuda:2.")
DEVICE_PATTERN = re.compile(r"(auto|(cpu|cuda)(:[0-9]+)?)")
DEVICES_PATTERN = re.compile(r"(auto|(cpu|cuda)(:[0-9]+)?(,(cpu|cuda)(:[0-9]+)?)*)")


def check_device_text(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """The --device value's spelling, checked as the command line is parsed (exit 2 before any model
    or library loads); whether CUDA is there is checked by the library (:func:`kvtool.core.placement.resolve_device`)."""
    if value is not None and not DEVICE_PATTERN.fullmatch(value):
        raise click.UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {value!r}", ctx=ctx)
    return value


def check_devices_text(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """:func:`check_device_text` for the commands that spread layers over several devices (a list is allowed)."""
    if value is not None and not DEVICES_PATTERN.fullmatch(value):
        raise click.UsageError(f"--device must be auto, cpu, cuda, cuda:N or a list such as cuda:0,cuda:2, got {value!r}", ctx=ctx)
    return value


DeviceOpt = Annotated[str, typer.Option("--device", help=DEVICE_HELP, callback=check_device_text, autocompletion=complete_device)]
DevicesOpt = Annotated[str, typer.Option("--device", help=DEVICES_HELP, callback=check_devices_text, autocompletion=complete_device)]
