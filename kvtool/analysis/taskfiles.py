"""The files of a ``kvtool tasks`` folder: ``run.json`` (what the run is) and ``samples.jsonl`` (one
row per sample and setting, appended as they are scored).

Rules, so that an interrupted run, a full disk or a second process on the same folder never loses
or swallows a row:

- every file of the folder is a regular file (a FIFO, device or folder in its place is bad data,
  exit 1, refused before anything blocks on it) and the folder is writable, checked before any work;
- rows are appended under an exclusive lock (``flock``), each batch in one ``write`` of whole lines;
  a batch cut by a full disk is taken back (the file truncated to where it was) and the error is
  the documented ``cannot write PATH: No space left on device``;
- a last line without its newline is a write that was cut (a killed process): it is dropped, with
  a note, before the next append, so the next row never lands glued to it; a line glued that way
  by an earlier kvtool is split and its row kept;
- any other line that is not a row (not JSON, not UTF-8, JSON that is not a row) is bad data:
  exit 1 naming the line;
- ``--force`` starts over without losing anything: the old rows move to ``samples.<time>.jsonl``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.limits import parse_json_text, read_text_input
from kvtool.core.outputs import atomic_write_text, output_folder, refuse_input

ROWS = "samples.jsonl"
RUN = "run.json"
# every file kvtool tasks writes into its folder
FILES = (ROWS, RUN, "tasks.json", "tasks.csv", "frontier.png")
# a row's fields and their types (what a line must hold to be a row)
ROW_FIELDS = {"sample": str, "setting": str, "method": str, "task": str, "length": int}
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


def check_folder(out_dir: Path, inputs: tuple | list = ()) -> None:
    """Before any work: ``out_dir`` is a folder (made if missing) kvtool can write, none of its files
    is a FIFO, device or folder, and none is an input of the command (a ``plan:FILE`` that is its
    ``tasks.json``). UsageError (exit 2) otherwise; BadDataError for a file that is not a regular file."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out-dir {out_dir} is a file, not a folder")
    for name in FILES:
        path = out_dir / name
        refuse_input(path, inputs)
        with contextlib.suppress(FileNotFoundError):
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                raise BadDataError(f"{path} is not a regular file (a folder, FIFO, device or link); move it away or choose another --out-dir")
    output_folder(out_dir)


def read_run(path: Path) -> dict[str, Any] | None:
    """The identity in ``run.json`` (None when there is none); BadDataError for a file that is not one."""
    if not path.exists():
        return None
    data = parse_json_text(read_text_input(path, str(path), record=False), str(path))
    if not isinstance(data, dict):
        raise BadDataError(f"{path}: not the run.json of kvtool tasks (a JSON object); move it away or pass --force")
    return data


def write_run(path: Path, identity: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(identity) + "\n", force=True)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[int]:
    """An exclusive ``flock`` on ``path`` (created if missing; never a FIFO: opened without blocking
    and checked), held for the block; yields the descriptor, opened for reading and appending."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError as exc:
        if exc.errno in _WRITE_ERRNOS:
            raise BadDataError(f"cannot write {path}: {exc.strerror}") from None
        raise UsageError(f"{path}: cannot open ({exc.strerror or exc}); move it away or choose another --out-dir") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadDataError(f"{path} is not a regular file (a folder, FIFO, device or link); move it away or choose another --out-dir")
        os.set_blocking(fd, True)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def _is_row(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(k), t) and not isinstance(value.get(k), bool) for k, t in ROW_FIELDS.items())


def _glued_row(line: str) -> dict[str, Any] | None:
    """The row at the end of a line that an earlier kvtool appended after a cut line, or None."""
    at = line.rfind('{"sample": ')
    while at > 0:
        with contextlib.suppress(ValueError):
            row = json.loads(line[at:])
            if _is_row(row):
                return row
        at = line.rfind('{"sample": ', 0, at)
    return None


def parse_rows(data: bytes, path: Path, note: Callable[[str], None] = lambda _: None) -> tuple[list[dict[str, Any]], int]:
    """The rows in ``data`` (the bytes of ``samples.jsonl``) and the length of its complete lines
    (a last line without its newline is a cut write: left out, with a note). BadDataError naming
    the line for one that is not a row."""
    end = data.rfind(b"\n") + 1
    if end < len(data):
        note(f"{path}: its last line was cut by an interrupted write ({len(data) - end} bytes); it is dropped and that sample is run again")
    rows = []
    for n, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadDataError(f"{path}: line {n} is not UTF-8 text; it is no kvtool tasks row (move the file away or pass --force)") from None
        try:
            row = json.loads(line)
        except ValueError:
            row = _glued_row(line)
            if row is None:
                raise BadDataError(f"{path}: line {n} is not JSON; it is no kvtool tasks row (move the file away or pass --force)") from None
            note(f"{path}: line {n} starts with a line cut by an interrupted write; its row is kept, the cut part dropped")
        if not _is_row(row):
            fields = ", ".join(f"{k} ({t.__name__})" for k, t in ROW_FIELDS.items())
            raise BadDataError(f"{path}: line {n} is JSON but not a kvtool tasks row (one needs {fields}); move the file away or pass --force")
        rows.append(row)
    return rows, end


def read_rows(path: Path, note: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The rows of ``samples.jsonl``, the first of each (sample, setting, question) (two processes
    working on one folder may both have scored a sample); [] when there is no file."""
    if not path.exists():
        return []
    rows, _ = parse_rows(_read_bytes(path), path, note)
    seen: set[tuple[Any, ...]] = set()
    out = []
    for row in rows:
        key = (row["sample"], row["setting"], row.get("question"))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def _read_bytes(path: Path) -> bytes:
    """The bytes of a regular file, opened without blocking (a FIFO is refused, never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise BadDataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise BadDataError(f"{path} is not a regular file (a folder, FIFO, device or link); move it away or choose another --out-dir")
        return fh.read()


def repair(path: Path, note: Callable[[str], None] = lambda _: None) -> None:
    """Drop a cut last line of ``samples.jsonl`` (under its lock), so the next append starts a line."""
    if not path.exists():
        return
    with locked(path) as fd:
        _drop_cut_tail(fd, path, note)


def _drop_cut_tail(fd: int, path: Path, note: Callable[[str], None]) -> None:
    size = os.fstat(fd).st_size
    if not size:
        return
    tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
    if tail.endswith(b"\n"):
        return
    cut = tail.rfind(b"\n")
    keep = size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= len(tail) else None)
    if keep is None:  # a last line longer than 1 MiB: read the whole file to find its start
        keep = _read_bytes(path).rfind(b"\n") + 1
    note(f"{path}: its last line was cut by an interrupted write ({size - keep} bytes); it is dropped and that sample is run again")
    os.ftruncate(fd, keep)


def append_rows(path: Path, rows: list[dict[str, Any]], note: Callable[[str], None] = lambda _: None) -> None:
    """Append ``rows`` as whole lines, under the file's lock: a cut last line is dropped first; a
    write that fails (full disk) is taken back and is the documented BadDataError."""
    data = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
    with locked(path) as fd:
        _drop_cut_tail(fd, path, note)
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            if exc.errno in _WRITE_ERRNOS:
                raise BadDataError(f"cannot write {path}: {exc.strerror}") from None
            raise


def move_aside(path: Path) -> Path | None:
    """``--force``: move ``samples.jsonl`` to ``samples.<UTC time>.jsonl`` (never over a file);
    returns where it went, or None when there was none."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1000):
        target = path.with_name(f"{path.stem}.{stamp}{'' if not n else f'-{n}'}{path.suffix}")
        try:
            os.link(path, target)
        except FileExistsError:
            continue
        except OSError:
            if target.exists():
                continue
            os.rename(path, target)
            return target
        os.unlink(path)
        return target
    raise BadDataError(f"{path}: cannot move the earlier rows aside (1000 names taken); move the file away")


# the fields of a tasks.json summary that readers (kvtool report --tasks) compute with, and their kinds
_NUMBER, _OPT_NUMBER, _INT, _STR, _OPT_STR = "number", "number or null", "integer", "text", "text or null"
SUMMARY_FIELDS = {
    "by_setting": {"setting": _STR, "method": _STR, "budget": _OPT_NUMBER, "accuracy": _OPT_NUMBER, "lo": _OPT_NUMBER, "hi": _OPT_NUMBER,
                   "n": _INT, "storage_ratio": _OPT_NUMBER},
    "cells": {"setting": _STR, "task": _STR, "length": _INT, "n": _INT, "accuracy": _OPT_NUMBER, "lo": _OPT_NUMBER, "hi": _OPT_NUMBER},
    "tasks": {"task": _STR, "length": _INT},
}


def _kind_ok(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or null")
    if isinstance(value, bool):
        return False
    if kind.startswith("number"):
        return isinstance(value, (int, float)) and math.isfinite(value)
    if kind == _INT:
        return isinstance(value, int)
    return isinstance(value, str)


def check_summary(data: Any, where: str) -> dict[str, Any]:
    """``data`` (a parsed ``tasks.json``) if every field a reader computes with has its kind;
    BadDataError naming the first one that does not (a hand-edited or foreign file)."""
    if not isinstance(data, dict):
        raise BadDataError(f"{where}: not a kvtool tasks summary (a JSON object)")
    for part, fields in SUMMARY_FIELDS.items():
        items = data.get(part, [] if part == "tasks" else None)
        if not isinstance(items, list):
            raise BadDataError(f"{where}: not a kvtool tasks summary (\"{part}\" must be a list)")
        for n, item in enumerate(items):
            if not isinstance(item, dict):
                raise BadDataError(f"{where}: {part}[{n}] is not an object")
            for key, kind in fields.items():
                if not _kind_ok(item.get(key), kind):
                    raise BadDataError(f"{where}: {part}[{n}].{key} must be {kind}, got {json.dumps(item.get(key))[:40]}")
    return data
