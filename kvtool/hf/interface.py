"""kvtool's attention functions in transformers: registering them and switching a model to one.

transformers (5.x) dispatches every attention layer through ``AttentionInterface`` by the name in
``model.config._attn_implementation``; kvtool registers its functions there (capture, compressed
prefixes, exported caches) together with an SDPA-style mask builder under the same name. The
cache argument's name (``past_key_values``, ``cache`` from 5.24 on) is chosen here too."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator


@functools.lru_cache(maxsize=None)
def _forward_parameters(model_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def forward_takes(model: Any, name: str) -> bool:
    """Whether ``model``'s forward takes the keyword ``name`` (inspected once per model class)."""
    return name in _forward_parameters(type(model))


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)`` and ``model.generate(...)``: ``cache`` where the
    model's forward takes it (transformers renamed ``past_key_values``, deprecated, to be removed
    in 5.40), else ``past_key_values``."""
    return {"cache" if forward_takes(model, "cache") else "past_key_values": cache}


def output_cache(out: Any) -> Any:
    """The cache a forward returned (``out.cache``, ``out.past_key_values`` before the rename)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def register_attention(name: str, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as attention implementation ``name``, with SDPA's mask builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, fn)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def set_attention(model: Any, name: str) -> str | None:
    """Switch ``model`` to attention implementation ``name``; return the previous one."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous == name:
        return previous
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    return previous


@contextlib.contextmanager
def attention_implementation(model: Any, name: str) -> Iterator[None]:
    """Within the block ``model`` attends through ``name``; the previous implementation is restored
    on exit (also on errors)."""
    previous = set_attention(model, name)
    try:
        yield
    finally:
        if previous is not None and previous != name:
            try:
                set_attention(model, previous)
            except (KeyError, ValueError):  # an implementation this transformers cannot switch back to
                model.config._attn_implementation = previous
