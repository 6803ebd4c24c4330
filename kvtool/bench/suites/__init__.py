"""The ``kvtool bench`` suites: one module per kernel family, each registering its subcommands with
:func:`~kvtool.bench.suites.common.register_suite`. A new suite is one module in this folder."""

from __future__ import annotations

import importlib
import pkgutil

from kvtool.bench.suites.common import SUITES, BenchContext, Suite, register_suite, require_kernel

_loaded = False


def load_suites() -> dict[str, Suite]:
    """Import every suite module of this package; return the registry (subcommand -> Suite)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in pkgutil.iter_modules(__path__):
            if mod.name != "common":
                importlib.import_module(f"{__name__}.{mod.name}")
    return SUITES


__all__ = ["SUITES", "BenchContext", "Suite", "load_suites", "register_suite", "require_kernel"]
