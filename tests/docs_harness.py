"""The example commands of kvtool's help, README and docs, and a parser that checks one without running it.

:func:`doc_examples` finds every ``kvtool ...`` line of the fenced blocks of README.md and docs/*.md
(continuation lines joined, ``$`` prompts, leading ``VAR=value`` settings and shell comments dropped);
:func:`help_examples` every example line of every command's ``--help`` (the epilog's ``kvtool ...``
lines). :func:`parse_only` parses an argument list exactly as ``kvtool`` would (the same argv rewriting,
Click's types and callbacks) and returns the command's parameters, without running the command.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import click
import typer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", flags=re.S | re.M)
SETTING = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def command_words(line: str) -> list[str] | None:
    """The arguments after ``kvtool`` of one shell line (``$`` prompt, ``VAR=1`` settings, ``time`` and
    comments dropped; the first command of a pipe or ``&&`` list), or None when the line runs no kvtool."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and (words[0] in ("$", "time") or SETTING.match(words[0])):
        words = words[1:]
    if not words or words[0] != "kvtool":
        return None
    words = words[1:]
    for stop in ("|", "&&", "||", ";", ">", "2>", ">>", "&"):
        if stop in words:
            words = words[: words.index(stop)]
    return words


def block_lines(body: str) -> list[str]:
    """A fenced block's lines with ``\\``-continued lines joined."""
    out: list[str] = []
    pending = ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def doc_examples() -> list[tuple[str, int, list[str]]]:
    """``(file name, line number, arguments)`` of every ``kvtool`` command in a fenced shell-like block
    (no language, ``bash``, ``sh``, ``shell``, ``console``, ``text``) of the README and docs/*.md."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) not in ("", "bash", "sh", "shell", "console", "text"):
                continue
            start = text.count("\n", 0, m.start(2)) + 1
            for n, line in enumerate(block_lines(m.group(2))):
                words = command_words(line.strip())
                if words:
                    found.append((doc.name, start + n, words))
    return found


def root_command() -> click.Group:
    from kvtool.cli import app

    return typer.main.get_command(app)  # type: ignore[return-value]


def walk_commands(cmd: click.Command | None = None, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command and group below the root, with its path of names."""
    cmd = cmd or root_command()
    out = [(path, cmd)]
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd, info_name="kvtool")
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                out += walk_commands(sub, path + (name,))
    return out


def help_examples() -> list[tuple[str, list[str]]]:
    """``(command, arguments)`` of every example line (a line starting with ``kvtool``, after an optional
    ``VAR=value`` setting) in every command's epilog, which ``--help`` prints."""
    found = []
    for path, cmd in walk_commands():
        for line in (cmd.epilog or "").splitlines():
            words = command_words(line.strip())
            if words:
                found.append((" ".join(path) or "kvtool", words))
    return found


def parse_only(args: list[str]) -> dict[str, Any]:
    """Parse ``kvtool ARGS`` as the CLI does, down to the command, without running it; the command's
    parameters. A usage error raises Click's exception."""
    from kvtool.cli import _bench_json_alias, _multi_values

    argv = _multi_values(_bench_json_alias(list(args)))
    cmd: click.Command = root_command()
    ctx = cmd.make_context("kvtool", argv)
    while isinstance(cmd, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert sub is not None, f"no command {name!r}"
        ctx = sub.make_context(name, rest, parent=ctx)
        cmd = sub
    return ctx.params
