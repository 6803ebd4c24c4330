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
>>> kvtool.verify("bitmap.safetensors", model=False).rel_l2

See :class:`kvtool.core.cache.KVCache` for the container.
"""

from __future__ import annotations

from typing import Any

from kvtool._version import __version__
from kvtool.core.errors import BadDataError, KvtoolError, UsageError

# public name -> module that defines it (imported on first use)
_LAZY = {
    "KVCache": "kvtool.core.cache",
    "LayerKV": "kvtool.core.cache",
    "ModelFacts": "kvtool.core.cache",
    "load": "kvtool.api",
    "save": "kvtool.api",
    "capture": "kvtool.api",
    "compress": "kvtool.api",
    "decompress": "kvtool.api",
    "verify": "kvtool.api",
    "evaluate": "kvtool.api",
    "export": "kvtool.api",
    "stats": "kvtool.api",
    "prune": "kvtool.api",
    "info": "kvtool.api",
    "to_hf_cache": "kvtool.api",
    "sample_path": "kvtool.api",
    "CaptureResult": "kvtool.api",
    "CompressResult": "kvtool.api",
    "DecompressResult": "kvtool.api",
    "VerifyResult": "kvtool.api",
    "EvalResult": "kvtool.api",
    "ExportResult": "kvtool.api",
    "StatsResult": "kvtool.api",
    "PruneResult": "kvtool.api",
    "InfoResult": "kvtool.api",
}

__all__ = ["__version__", "KvtoolError", "BadDataError", "UsageError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
