"""Compression formats: one module per format, each registering itself (see :mod:`.base`)."""

from __future__ import annotations

from kvtool.formats.base import FORMATS, CompressedCache, Encoded, Format, FormatParams, get_format, load_all, register

__all__ = ["FORMATS", "CompressedCache", "Encoded", "Format", "FormatParams", "get_format", "load_all", "register"]
