"""kvtool: offline KV-cache toolkit.

The Python API mirrors the CLI:

>>> import kvtool
>>> cache = kvtool.capture(prompt="The capital of France is")   # embedded SmolLM2-135M
>>> kvtool.save(cache, "cap.safetensors")
>>> cache = kvtool.load("cap.safetensors")
>>> cache.layers[0].keys.shape          # [batch, kv_heads, tokens, head_dim]

See :class:`kvtool.cache.KVCache` for the container.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .cache import KVCache, LayerKV, ModelFacts
from .errors import BadDataError, KvtoolError, UsageError
from .io import load, save

__all__ = ["__version__", "KVCache", "LayerKV", "ModelFacts", "KvtoolError", "BadDataError", "UsageError", "load", "save", "capture"]


def capture(*args: Any, **kwargs: Any) -> KVCache:
    """Run a model on a prompt and return its KV cache; see :func:`kvtool.capturing.capture`."""
    from .capturing import capture as _capture

    return _capture(*args, **kwargs)
