"""How long-running library functions report progress without knowing who listens.

A function that works through stages (layers, sweep points, model passes) takes
``progress: Progress | None`` and calls ``progress.stage(what, total)`` when a stage starts and
``progress.advance()`` after each unit of it. The base class does nothing; the CLI passes one that
draws bars on a terminal and writes plain lines to stderr elsewhere.
"""

from __future__ import annotations


class Progress:
    """A progress sink. Subclasses override :meth:`stage` and :meth:`advance`; this one ignores both."""

    def stage(self, what: str, total: int | None = None) -> None:
        """A new stage of ``total`` units (None: unknown) begins; ``what`` names it for a person."""

    def advance(self, units: int = 1) -> None:
        """``units`` more units of the current stage are done."""

    def note(self, text: str) -> None:
        """A one-line account of a finished unit or step, for a person following the work."""


SILENT = Progress()


def or_silent(progress: Progress | None) -> Progress:
    """``progress`` itself, or the sink that ignores everything."""
    return progress if progress is not None else SILENT
