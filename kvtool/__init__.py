"""kvtool: offline KV-cache toolkit.

The Python API mirrors the CLI (see :mod:`kvtool.api`); importing ``kvtool`` is cheap, every
function loads what it needs when called:

>>> import kvtool
>>> cache = kvtool.capture(prompt="The capital of France is")   # embedded SmolLM2-135M
>>> kvtool.save(cache, "cap.safetensors")
>>> cache = kvtool.load("sample:")      # the capture bundled with kvtool
>>> cache.layers[7].keys.shape          # [batch, kv_heads, tokens, head_dim]
>>> result = kvtool.compress("sample:", "bitmap:sparsity=0.7", "bitmap.safetensors")
>>> result.storage_ratio, result.to_dict()["output"]
>>> kvtool.verify("bitmap.safetensors", model=False).rel_l2   # attention level only: the model is not run
>>> plan = kvtool.recommend("sample:", budget="15%", model=False, output="plan.json")
>>> kvtool.stats("sample:", progress=lambda stage, done, total: print(stage, done, total))

See :class:`kvtool.core.cache.KVCache` for the container.
"""

import sys as _sys
import types as _types
from typing import Any as _Any

from kvtool._version import __version__
from kvtool.core.errors import BadDataError, KvtoolError, UsageError

# public name -> module that defines it (imported on first use; tests/test_api.py checks the API's are all here)
_LAZY = {
    "KVCache": "kvtool.core.cache",
    "LayerKV": "kvtool.core.cache",
    "ModelFacts": "kvtool.core.cache",
    "Progress": "kvtool.core.progress",
    **{name: "kvtool.api" for name in (
        # functions: one per command (built from its declaration), and the few written by hand
        "info", "stats", "plot", "prune", "compress", "decompress", "heads", "verify", "recommend", "evaluate", "report",
        "export", "generate", "env", "version", "tasks", "capture", "load", "save", "to_hf_cache", "continuation_ids", "sample_path",
        # live use: a model decoding through compressed caches (written by hand, kvtool/api.py's last section)
        "load_model", "press", "answer",
        # their results
        "Result", "CompressResult", "DecompressResult", "VerifyResult", "EvalResult", "ExportResult", "StatsResult",
        "PruneResult", "InfoResult", "PlotResult", "HeadsResult", "RecommendResult", "ReportResult", "GenerateResult",
    )},
}

__all__ = ["__version__", "KvtoolError", "BadDataError", "UsageError", *_LAZY]


class _Package(_types.ModuleType):
    """The ``kvtool`` module: ``kvtool.export`` is the API function even after the subpackage
    ``kvtool.export`` (export layouts) is imported, which would otherwise replace the attribute with
    the subpackage (``import kvtool.export.convert`` still works: it goes through ``sys.modules``)."""

    @property
    def export(self) -> _Any:
        return __getattr__("export")

    @export.setter
    def export(self, value: _Any) -> None:
        if not isinstance(value, _types.ModuleType):  # the import system sets the subpackage here: ignore it
            raise AttributeError("kvtool.export is the API function")


_sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API only (``__all__``): no imports, helpers or subpackages."""
    return sorted(__all__)
