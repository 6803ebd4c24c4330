"""kvtool: offline KV-cache toolkit.

The Python API mirrors the CLI:

>>> import kvtool
>>> cache = kvtool.capture(prompt="The capital of France is")   # embedded SmolLM2-135M
>>> kvtool.save(cache, "cap.safetensors")
>>> cache = kvtool.load("cap.safetensors")
>>> cache.layers[0].keys.shape          # [batch, kv_heads, tokens, head_dim]
>>> past = kvtool.to_hf_cache("cap.safetensors", model)   # a transformers cache for model.generate

See :class:`kvtool.cache.KVCache` for the container.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .cache import KVCache, LayerKV, ModelFacts
from .errors import BadDataError, KvtoolError, UsageError
from .io import load, save

__all__ = ["__version__", "KVCache", "LayerKV", "ModelFacts", "KvtoolError", "BadDataError", "UsageError", "load", "save", "capture", "to_hf_cache"]


def capture(*args: Any, **kwargs: Any) -> KVCache:
    """Run a model on a prompt and return its KV cache; see :func:`kvtool.capturing.capture`."""
    from .capturing import capture as _capture

    return _capture(*args, **kwargs)


def to_hf_cache(path: Any, model: Any, mode: str = "auto", hold_last: bool = False) -> Any:
    """A transformers cache (``model.generate(..., past_key_values=cache)``) from a kvtool file; see
    :func:`kvtool.hfcache.to_hf_cache`."""
    from .hfcache import to_hf_cache as _to_hf_cache

    return _to_hf_cache(path, model, mode=mode, hold_last=hold_last)
