"""How long-running library functions report progress without knowing who listens.

A function that works through stages (layers, sweep points, model passes) takes
``progress: Progress | None`` and calls ``progress.stage(what, total)`` when a stage starts and
``progress.advance()`` after each unit of it. The base class does nothing. The sinks here are the
one progress style of kvtool, used by the CLI and the Python API alike:

- :class:`BarProgress`: a rich bar on a terminal (done/total, elapsed, time left);
- :class:`LineProgress`: plain lines anywhere else, one when a stage starts and then at least every
  ``heartbeat`` seconds: ``kvtool verify: dense pass 12/60 (20%), 14 s, 0.9/s, about 53 s left``;
- :class:`CallbackProgress`: calls ``fn(stage, done, total)`` (the Python API's ``progress=``).

:func:`make_sink` picks one from what a caller asked for.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable


class Progress:
    """A progress sink. Subclasses override :meth:`stage` and :meth:`advance`; this one ignores both."""

    def stage(self, what: str, total: int | None = None) -> None:
        """A new stage of ``total`` units (None: unknown) begins; ``what`` names it for a person."""

    def advance(self, units: int = 1) -> None:
        """``units`` more units of the current stage are done."""

    def note(self, text: str) -> None:
        """A one-line account of a finished unit or step, for a person following the work."""

    def close(self, failed: bool = False) -> None:
        """The work is over (``failed``: it stopped with an error)."""


SILENT = Progress()


def or_silent(progress: Progress | None) -> Progress:
    """``progress`` itself, or the sink that ignores everything."""
    return progress if progress is not None else SILENT


def fmt_duration(seconds: float) -> str:
    """``41 s``, ``3 min 05 s``, ``2 h 04 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def fmt_rate(per_second: float) -> str:
    """``3.2/s`` for quick units, ``12 s each`` for slow ones."""
    if per_second >= 1:
        return f"{per_second:.1f}/s"
    return f"{1 / per_second:.0f} s each" if per_second > 0 else "-"


class StageClock:
    """Where the current stage is: units done of the total, when it began; rate and time left."""

    def __init__(self) -> None:
        self.what: str | None = None
        self.total: int | None = None
        self.done = 0
        self.start = time.monotonic()
        self.stage_start = self.start

    def begin(self, what: str, total: int | None) -> None:
        self.what, self.total, self.done = what, total, 0
        self.stage_start = time.monotonic()

    def rate(self) -> float | None:
        """Units per second in this stage (None before the first unit)."""
        spent = time.monotonic() - self.stage_start
        return self.done / spent if self.done and spent > 0 else None

    def left(self) -> float | None:
        """Seconds this stage still needs at its rate so far (None when unknown)."""
        rate = self.rate()
        if rate is None or not self.total:
            return None
        return max(0, self.total - self.done) / rate

    def line(self, command: str) -> str:
        """``kvtool COMMAND: STAGE 3/12 (25%), 41 s, 0.1/s... about 2 min left``."""
        elapsed = fmt_duration(time.monotonic() - self.start)
        if self.total:
            how_far = f"{self.done}/{self.total} ({100 * self.done / self.total:.0f}%), {elapsed}"
        else:
            how_far = f"{self.done} done, {elapsed}" if self.done else f"started, {elapsed}"
        rate, left = self.rate(), self.left()
        if rate is not None:
            how_far += f", {fmt_rate(rate)}"
        if left is not None and self.done < (self.total or 0):
            how_far += f", about {fmt_duration(left)} left"
        return f"kvtool {command}: {self.what} {how_far}"


class LineProgress(Progress):
    """Progress off a terminal: one plain line (on ``stream``, default stderr) when a stage starts,
    and while it runs at least every ``heartbeat`` seconds, from a background thread, so one long
    unit of work still shows life; a last ``done in`` line on :meth:`close`."""

    def __init__(self, command: str | None, stream: Any = None, heartbeat: float = 10.0):
        self.command = command or "kvtool"
        self.stream = stream
        self.heartbeat = heartbeat
        self.clock = StageClock()
        self.last_line = time.monotonic()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stderr
        stream.write(text + "\n")
        stream.flush()
        self.last_line = time.monotonic()

    def stage(self, what: str, total: int | None = None) -> None:
        with self.lock:
            self.clock.begin(what, total)
            self._write(self.clock.line(self.command))
        if self.thread is None:
            self.thread = threading.Thread(target=self._beat, name="kvtool-progress", daemon=True)
            self.thread.start()

    def advance(self, units: int = 1) -> None:
        with self.lock:
            self.clock.done += units
            if time.monotonic() - self.last_line >= self.heartbeat:
                self._write(self.clock.line(self.command))

    def note(self, text: str) -> None:
        with self.lock:
            self._write(f"kvtool {self.command}: {text}")

    def _beat(self) -> None:
        while not self.stop_event.wait(min(1.0, self.heartbeat)):
            with self.lock:
                if self.clock.what is not None and time.monotonic() - self.last_line >= self.heartbeat:
                    self._write(self.clock.line(self.command))

    def close(self, failed: bool = False) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=2)
        if self.clock.what is not None:
            with self.lock:
                how = f"stopped during {self.clock.what} after" if failed else "done in"
                self._write(f"kvtool {self.command}: {how} {fmt_duration(time.monotonic() - self.clock.start)}")


class BarProgress(Progress):
    """Progress on a terminal: each stage is a task of a transient rich bar (description, bar,
    done/total, elapsed, time left), started with the first stage, so a command that fails before
    any stage prints nothing."""

    def __init__(self, console: Any):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("left"), TimeRemainingColumn(), console=console, transient=True)
        self.task = None
        self.started = False

    def stage(self, what: str, total: int | None = None) -> None:
        from rich.markup import escape  # deferred: rich loads only when a bar is drawn

        if not self.started:
            self.bar.start()
            self.started = True
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(escape(what), total=total)

    def advance(self, units: int = 1) -> None:
        if self.task is not None:
            self.bar.advance(self.task, units)

    def note(self, text: str) -> None:
        self.bar.console.print(text, markup=False, highlight=False)

    def close(self, failed: bool = False) -> None:
        if self.started:
            self.bar.stop()


class CallbackProgress(Progress):
    """Calls ``fn(stage, done, total)`` when a stage starts and after each unit (``total`` may be
    None); notes are not passed on."""

    def __init__(self, fn: Callable[[str, int, int | None], Any]):
        self.fn = fn
        self.what = ""
        self.total: int | None = None
        self.done = 0

    def stage(self, what: str, total: int | None = None) -> None:
        self.what, self.total, self.done = what, total, 0
        self.fn(what, 0, total)

    def advance(self, units: int = 1) -> None:
        self.done += units
        self.fn(self.what, self.done, self.total)


def make_sink(progress: Any, command: str, console: Any = None) -> Progress:
    """The sink for a caller's ``progress``: a :class:`Progress` as it is; a callable wrapped in
    :class:`CallbackProgress`; False/None: silent; True or ``"auto"``: a rich bar when ``console``
    (default: rich's stderr console) is a terminal, else :class:`LineProgress` on stderr."""
    if isinstance(progress, Progress):
        return progress
    if progress is None or progress is False:
        return SILENT
    if callable(progress):
        return CallbackProgress(progress)
    if progress is True or progress == "auto":
        if console is None:
            from rich.console import Console  # deferred: rich loads only when progress is shown

            console = Console(stderr=True)
        return BarProgress(console) if console.is_terminal else LineProgress(command)
    raise TypeError(f"progress must be a Progress, a callable (stage, done, total), True, False or 'auto', not {progress!r}")


def stage_callback(sink: Progress) -> Callable[[str, int, int], None]:
    """Adapt a sink to the ``progress(stage, done, total)`` callables some library functions take."""
    state: dict[str, Any] = {"stage": None, "done": 0}

    def report(stage: str, done: int, total: int) -> None:
        if stage != state["stage"]:
            state.update(stage=stage, done=0)
            sink.stage(stage, total)
        if done > state["done"]:
            sink.advance(done - state["done"])
            state["done"] = done

    return report
