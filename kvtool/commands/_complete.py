"""Shell completion of option values (``kvtool --install-completion`` sets it up): format names,
models (``embedded``, ``random:SHAPE``, local HF folders and ``.gguf`` files) and devices. Each
function takes what was typed so far and returns the candidates, without importing torch: the names
come from the modules' source (:mod:`kvtool.commands._catalog`)."""

from __future__ import annotations

import os
from pathlib import Path

from kvtool.commands._catalog import format_summaries, model_shape_names
from kvtool.core.names import FORMAT_ALIASES

DEVICES = ("auto", "cpu", "cuda", *(f"cuda:{i}" for i in range(8)))
EVICT_POLICIES = ("snapkv", "streaming")


def complete_format(incomplete: str) -> list[str]:
    """Registered format names (``bitmap``, ``quant`` ...); after ``NAME+`` the next step's name."""
    head, plus, tail = incomplete.rpartition("+")
    return [f"{head}{plus}{name}" for name in (*format_summaries(), *FORMAT_ALIASES) if name.startswith(tail)]


def _local_models(incomplete: str) -> list[str]:
    """Folders (a HF model folder is a folder) and ``.gguf`` files under what was typed."""
    folder, _, stem = incomplete.rpartition(os.sep)
    base = Path(folder or ".")
    if not base.is_dir():
        return []
    out = []
    for p in sorted(base.iterdir())[:200]:
        if p.name.startswith(stem) and not p.name.startswith(".") and (p.is_dir() or p.suffix == ".gguf"):
            out.append(os.path.join(folder, p.name) if folder else p.name)
    return out


def complete_model(incomplete: str) -> list[str]:
    """``embedded``, ``random:SHAPE`` for every named shape, and local model folders or GGUF files."""
    named = ["embedded", *(f"random:{s}" for s in model_shape_names())]
    return [m for m in named if m.startswith(incomplete)] + _local_models(incomplete)


def complete_device(incomplete: str) -> list[str]:
    """``auto``, ``cpu``, ``cuda`` and ``cuda:0`` .. ``cuda:7``."""
    return [d for d in DEVICES if d.startswith(incomplete)]


def complete_evict(incomplete: str) -> list[str]:
    """Eviction policies of ``--evict POLICY:budget=N``."""
    return [f"{p}:budget=" for p in EVICT_POLICIES if p.startswith(incomplete)]
