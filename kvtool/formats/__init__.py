"""Compression formats: one module per format, each registering itself (see :mod:`.base`)."""

from __future__ import annotations

import importlib
import pkgutil

from .base import FORMATS, CompressedCache, Encoded, Format, FormatParams, get_format, register

_loaded = False


def load_all() -> dict[str, Format]:
    """Import every module of this package so its formats register; return the registry."""
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in pkgutil.iter_modules(__path__):
            if not mod.name.startswith("_") and mod.name != "base":
                importlib.import_module(f"{__name__}.{mod.name}")
    return FORMATS


__all__ = ["FORMATS", "CompressedCache", "Encoded", "Format", "FormatParams", "get_format", "load_all", "register"]
