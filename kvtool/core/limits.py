"""Bounds on the work a command line or a file can ask for, checked before the work starts.

One rule for every size a user or a file gives kvtool (budgets, page sizes, groups, windows, layer
counts, the text files it reads): a size is an integer within a stated range, or a UsageError (exit 2)
naming the option and the range; a number too large for any allocation is never handed to torch
(no ``OverflowError``, no C++ frames). Sizes measured in tokens that exceed the tokens they apply to
are then clamped or refused by the format that uses them, before it allocates anything.

Text inputs (prompt files, plan files, ``eval.json``, bench JSON, ``--texts``) are read by
:func:`read_text_input`: regular files only (never a FIFO, device or folder, so nothing blocks or
reads forever), at most :data:`MAX_TEXT_BYTES`, UTF-8; :func:`read_json_input` adds a JSON object
of bounded nesting without NaN/Infinity. Every file read this way is recorded as an input of the
running command (:func:`kvtool.core.outputs.note_input`), so no output can overwrite it.

No torch here: the CLI checks its options with these at start-up.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from kvtool.core.errors import BadDataError, KvtoolError, UsageError
from kvtool.core.outputs import note_input

# tokens: a context longer than this is beyond any model kvtool reads (2^24 = 16.7M)
MAX_TOKENS = 1 << 24
# a page of more tokens than this is no serving layout (engines use 1 to 256)
MAX_PAGE_SIZE = 1 << 12
# layers of a model (the deepest public models have about 130)
MAX_LAYERS = 1 << 12
# heads, head_dim, hidden size (the widest public models are below 2^16)
MAX_WIDTH = 1 << 17
# a safetensors header (a capture's is tens of KiB; the largest compressed files' a few MiB)
MAX_HEADER_BYTES = 16 << 20
# prompt files, plan files, eval and bench JSON, --texts
MAX_TEXT_BYTES = 64 << 20
# nesting of any JSON kvtool reads from a file (plans, eval, bench)
MAX_JSON_DEPTH = 64
# tokens a live cache layer allocates beyond those it holds where a parameter measured in tokens
# (quant group or residual, bitmap dense_window; up to MAX_TOKENS) would ask for more: its buffers
# follow the tokens held and grow as tokens come, never a parameter's worth ahead
LIVE_HEADROOM = 4096


def bounded_int(name: str, value: Any, low: int, high: int) -> int:
    """``value`` (an int or its text) as an int in ``[low, high]``; UsageError naming ``name`` and the
    range otherwise (a bool, a float, text that is not an integer, a number of any size)."""
    if isinstance(value, bool):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if len(text.lstrip("+-0")) > 40:
            raise UsageError(f"{name} must be at most {high}, got {text[:24]}...")
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{name} must be an integer, got {text!r}") from None
    elif isinstance(value, float):
        if not value.is_integer():
            raise UsageError(f"{name} must be an integer, got {value!r}")
        value = int(value)
    elif not isinstance(value, int):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    if value > high:
        raise UsageError(f"{name} must be at most {high}, got {value}")
    if value < low:
        raise UsageError(f"{name} must be at least {low}, got {value}")
    return value


def finite_float(name: str, value: Any) -> float:
    """``value`` as a finite float; UsageError naming ``name`` for text that is no number, NaN or infinity."""
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out):
        raise UsageError(f"{name} must be a finite number, got {value!r}")
    return out


def read_text_input(path: str | Path, what: str, limit: int = MAX_TEXT_BYTES, error: type[KvtoolError] = BadDataError,
                    record: bool = True) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes; ``error`` (BadDataError
    by default) naming ``what`` (``--prompt-file x.txt``) for a missing file, a FIFO, device or
    folder, a larger file or bytes that are not UTF-8. Opened without blocking, so a FIFO swapped in
    after the check cannot hang the command. ``record``: the file is an input of the running command
    (False for a command's own state, such as eval's ``eval.json`` that it rewrites)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what}: no such file") from None
    except OSError as exc:
        raise error(f"{what}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what}: not a regular file (a folder, FIFO or device); give a file")
    if st.st_size > limit:
        raise error(f"{what}: {st.st_size} bytes, more than the {limit} kvtool reads")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise error(f"{what}: cannot read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise error(f"{what}: not a regular file (a folder, FIFO or device); give a file")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what}: more than the {limit} bytes kvtool reads")
    if record:
        note_input(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not UTF-8 text (byte {exc.start})") from None


def read_stream_text(stream: Any, what: str, limit: int = MAX_TEXT_BYTES, error: type[KvtoolError] = UsageError) -> str:
    """At most ``limit`` bytes of text from ``stream`` (stdin); ``error`` if there are more."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what}: more than the {limit} bytes kvtool reads")
    return data


def _too_deep(data: Any, limit: int) -> bool:
    """True when ``data`` (parsed JSON) nests lists/objects more than ``limit`` levels deep."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def parse_json_text(text: str, what: str, error: type[KvtoolError] = BadDataError) -> Any:
    """``text`` as JSON: nesting of at most :data:`MAX_JSON_DEPTH`, no NaN/Infinity, no numbers that
    overflow to infinity, no key twice in one object; ``error`` naming ``what`` otherwise."""
    def bad_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def checked_float(text_: str) -> float:
        value = float(text_)
        if not math.isfinite(value):
            raise ValueError(f"number {text_} is out of range")
        return value

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) < len(pairs):
            seen: set[str] = set()
            twin = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise ValueError(f"the key {twin[:40]!r} appears twice in one object; which one was meant is not for kvtool to guess")
        return out

    try:
        data = json.loads(text, parse_constant=bad_constant, parse_float=checked_float, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise error(f"{what}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise error(f"{what}: the JSON nests more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:
        raise error(f"{what}: not valid JSON ({exc})") from None
    if _too_deep(data, MAX_JSON_DEPTH):
        raise error(f"{what}: the JSON nests more than {MAX_JSON_DEPTH} levels deep")
    return data


def read_json_input(path: str | Path, what: str, limit: int = MAX_TEXT_BYTES, error: type[KvtoolError] = BadDataError,
                    record: bool = True) -> Any:
    """:func:`read_text_input` then :func:`parse_json_text`."""
    return parse_json_text(read_text_input(path, what, limit, error, record), what, error)
