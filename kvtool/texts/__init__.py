"""Held-out texts shipped with kvtool for model-level fidelity: original prose, code and dialogue
written for kvtool (Apache-2.0, as the project), each a few thousand tokens, none of it the
built-in capture prompt. :func:`shipped` lists them; :func:`read_files` reads a user's ``--texts``."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvtool.core.errors import UsageError
from kvtool.core.limits import read_text_input

NAMES = ("prose", "code", "dialogue")


def shipped() -> list[tuple[str, str]]:
    """``[(name, text)]`` of the shipped texts (``kvtool/texts/NAME.txt``)."""
    root = resources.files(__name__)
    return [(n, (root / f"{n}.txt").read_text(encoding="utf-8")) for n in NAMES]


def read_files(paths: list[Path]) -> list[tuple[str, str]]:
    """``[(file stem, text)]`` of the user's text files (UTF-8); UsageError for a missing or empty one."""
    out = []
    for p in paths:
        p = Path(p)
        # a regular file of bounded size (never a FIFO or device), UTF-8
        text = read_text_input(p, f"--texts {p}", error=UsageError)
        if not text.strip():
            raise UsageError(f"--texts {p} is empty")
        out.append((p.stem, text))
    return out
