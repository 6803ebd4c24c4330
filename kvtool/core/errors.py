"""Errors that reach the user as one clear line.

Commands catch :class:`KvtoolError` and print ``error: <message>``; the exit code is the error's
``exit_code``: 1 for bad data (a file, a model, a tensor that is wrong), 2 for bad usage (an option
or a combination of options that cannot work). Anything else is a bug and shows a traceback only
with ``--debug``.
"""

from __future__ import annotations


class KvtoolError(Exception):
    """Base class: a problem the user can act on. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class BadDataError(KvtoolError):
    """The data is wrong: a file that is not a kvtool file, truncated, or inconsistent; a model
    that cannot be loaded; tensors whose shapes disagree. Exit code 1."""

    exit_code = 1


class UsageError(KvtoolError):
    """The request is wrong: an option out of range, options that do not go together. Exit code 2."""

    exit_code = 2


class OutputExistsError(UsageError):
    """An output file exists and ``--force`` was not given."""

    def __init__(self, path, why: str = "exists; pass --force to overwrite it") -> None:
        super().__init__(f"{path} {why}")
