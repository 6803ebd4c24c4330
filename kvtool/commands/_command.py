"""One declaration per command, read by both the CLI and the Python API.

A command module declares each command once, as a plain function whose parameters carry Typer's
``Annotated`` options and which returns an :class:`Outcome` (the ``--json`` object's own keys, the
input and output)::

    @declare("prune", help="...", epilog=example_epilog(...), render=print_report)
    def prune(capture: CaptureArg, sparsity: Annotated[float, typer.Option(help="...")] = 0.7, *,
              progress: Progress) -> Outcome:
        report = prune_file(capture, ..., progress=progress)
        return Outcome(report, input=capture, output=report["output"])

and ``register(app)`` calls :func:`add_commands`. The CLI function built from it
(:func:`cli_function`) adds the options every command has (``--json``, ``-q/--quiet``,
``--debug``), turns errors into one line (:func:`kvtool.commands._common.kvtool_command`), gives
the body the CLI's progress sink, then prints the outcome as JSON or through ``render``.
:mod:`kvtool.api` builds the Python function of the same declaration (same parameter names and
defaults, ``progress=`` instead of the CLI-only options), so the two cannot drift.

An :class:`Api` object in a parameter's ``Annotated`` tells the Python API what differs there:
``Api(skip=True)`` leaves a CLI-only parameter out, ``Api(positional=True)`` lets an option be
passed by position, ``Api(type=...)`` widens the annotation the API shows (a model object as well
as a path). Hidden options (deprecated names) are never in the API.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

import typer

from kvtool.commands._common import (  # noqa: F401 (Api is declared there and used with declare)
    Api,
    DebugOpt,
    JsonOpt,
    QuietOpt,
    emit_json,
    kvtool_command,
    library_progress,
)


@dataclass
class Outcome:
    """What a declared command returns: ``data`` (the ``--json`` object's own keys), the file(s) it
    read and what it wrote; ``view`` holds anything ``render`` needs beyond ``data`` (objects that
    are not JSON); ``exit_code`` 1 marks a result that is bad data (a missed threshold)."""

    data: dict[str, Any]
    input: Any = None
    inputs: list[Any] | None = None
    output: Any = None
    view: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0


@dataclass
class CommandSpec:
    """A declared command: its name below ``kvtool`` (``"compress"``, ``"bench report"``), the
    function, its help, how it renders for people, and its Python API name (None: no API function)."""

    name: str
    fn: Callable[..., Outcome]
    help: str | Callable[[], str]
    epilog: str | None = None
    short_help: str | None = None
    render: Callable[[Outcome], None] | None = None
    api_name: str | None = None

    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help


COMMON = (("json_out", JsonOpt), ("quiet", QuietOpt), ("debug", DebugOpt))


def declare(name: str, *, help: str | Callable[[], str], epilog: str | None = None, short_help: str | None = None,
            render: Callable[[Outcome], None] | None = None, api: str | None | bool = True) -> Callable[[Callable[..., Outcome]], Callable[..., Outcome]]:
    """Mark ``fn`` as the declaration of command ``name`` (``api``: the Python function's name, True
    for the command's own name, None/False for none). ``help`` may be a callable, evaluated when the
    command is registered (for help built from the formats' source)."""

    def mark(fn: Callable[..., Outcome]) -> Callable[..., Outcome]:
        api_name = (name.replace(" ", "_") if api is True else api) or None
        fn.spec = CommandSpec(name, fn, help, epilog, short_help, render, api_name)  # type: ignore[attr-defined]
        return fn

    return mark


def spec_of(fn: Callable[..., Any]) -> CommandSpec:
    spec = getattr(fn, "spec", None)
    if not isinstance(spec, CommandSpec):
        raise TypeError(f"{fn!r} is not a declared command (see kvtool.commands._command.declare)")
    return spec


def declared_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The declaration's parameters with their annotations resolved (``Annotated[...]`` objects, not
    strings), ``progress`` left out."""
    hints = typing.get_type_hints(fn, include_extras=True)
    return [p.replace(annotation=hints.get(p.name, p.annotation)) for p in inspect.signature(fn).parameters.values() if p.name != "progress"]


def parameter_meta(annotation: Any) -> tuple[Any, Any, Api]:
    """(the plain type, Typer's ParameterInfo or None, the :class:`Api` marker) of an annotation."""
    from typer.models import ParameterInfo

    if typing.get_origin(annotation) is not Annotated:
        return annotation, None, Api()
    base, *meta = typing.get_args(annotation)
    info = next((m for m in meta if isinstance(m, ParameterInfo)), None)
    api = next((m for m in meta if isinstance(m, Api)), Api())
    return base, info, api


def cli_function(spec: CommandSpec) -> Callable[..., None]:
    """The Typer command function of a declaration: its parameters plus ``--json``, ``-q`` and
    ``--debug`` (unless declared), the CLI's progress sink, JSON or ``render`` output, and the
    outcome's exit code."""
    params = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in declared_parameters(spec.fn)]
    names = {p.name for p in params}
    params += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=False, annotation=a) for n, a in COMMON if n not in names]
    takes = set(inspect.signature(spec.fn).parameters)

    def command(**kwargs: Any) -> None:
        own = {k: v for k, v in kwargs.items() if k in takes}
        with library_progress(bool(kwargs.get("json_out")) or bool(kwargs.get("quiet"))) as sink:
            outcome = spec.fn(**own, progress=sink) if "progress" in takes else spec.fn(**own)
        if kwargs.get("json_out"):
            emit_json(outcome.data, input=outcome.input, inputs=outcome.inputs, output=outcome.output)
        elif spec.render is not None:
            spec.render(outcome)
        if outcome.exit_code:
            raise typer.Exit(outcome.exit_code)

    command.__name__ = spec.fn.__name__
    command.__doc__ = spec.fn.__doc__
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return kvtool_command(command)


def add_commands(app: typer.Typer, *fns: Callable[..., Outcome]) -> None:
    """Register declared commands on a Typer app (a command module's ``register``)."""
    for fn in fns:
        spec = spec_of(fn)
        app.command(spec.name.split()[-1], help=spec.help_text(), epilog=spec.epilog, short_help=spec.short_help)(cli_function(spec))
