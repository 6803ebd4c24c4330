"""kvtool: offline KV-cache toolkit.

The Python API mirrors the CLI:

>>> import kvtool
>>> cache = kvtool.capture(prompt="The capital of France is")   # embedded SmolLM2-135M
>>> kvtool.save(cache, "cap.safetensors")
>>> cache = kvtool.load("cap.safetensors")
>>> cache.layers[0].keys.shape          # [batch, kv_heads, tokens, head_dim]
>>> past = kvtool.to_hf_cache("cap.safetensors", model)   # a transformers cache for model.generate

See :class:`kvtool.core.cache.KVCache` for the container.
"""

from __future__ import annotations

from typing import Any

from kvtool._version import __version__
from kvtool.core.cache import KVCache, LayerKV, ModelFacts
from kvtool.core.errors import BadDataError, KvtoolError, UsageError
from kvtool.core.io import load, save

__all__ = ["__version__", "KVCache", "LayerKV", "ModelFacts", "KvtoolError", "BadDataError", "UsageError", "load", "save", "capture", "to_hf_cache"]


def capture(*args: Any, **kwargs: Any) -> KVCache:
    """Run a model on a prompt and return its KV cache; see :func:`kvtool.hf.capture.capture`."""
    from kvtool.hf.capture import capture as _capture  # deferred: transformers loads only when a capture is asked for

    return _capture(*args, **kwargs)


def to_hf_cache(path: Any, model: Any, mode: str = "auto", hold_last: bool = False) -> Any:
    """A transformers cache (``model.generate(..., past_key_values=cache)``) from a kvtool file; see
    :func:`kvtool.hf.cache.to_hf_cache`."""
    from kvtool.hf.cache import to_hf_cache as _to_hf_cache  # deferred: transformers loads only when asked for

    return _to_hf_cache(path, model, mode=mode, hold_last=hold_last)
