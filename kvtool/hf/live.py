"""Live caches in transformers: compression that is real in a running model.

A *live cache* is a transformers ``DynamicCache`` whose layers are :class:`LiveCacheLayer` s: each
holds one model layer's cache in a format's own encoded tensors on the device of its model layer (a
:class:`~kvtool.formats._live.LiveLayer`, built by the format's module) and grows the format's way
while the model decodes. A layer's ``update`` hands the new tokens to kvtool's attention function
(``kvtool``, :mod:`kvtool.hf.attention`), which calls :meth:`LiveLayer.step`: the new keys/values join
the encoded layer and the queries attend through the format's kernel (CUDA) or its torch reference
(CPU). Nothing dense stands in for the compressed tokens; every other cache keeps SDPA attention.

Three ways in:

- :func:`press` (a context manager): within it, every prefill that fills an empty ``DynamicCache``
  layer (what ``model.generate`` does with a prompt) compresses that layer right after its own
  attention ran on the dense prompt, in place, so at most one layer's dense prompt cache exists at
  a time; decoding then runs through the live cache. A format spec or a plan file.
- :func:`compress_hf_cache`: an existing transformers cache, compressed in place.
- :func:`live_cache_from`: a kvtool compressed file or object (``to_hf_cache`` does this).

Limits: equal-length batches (no padding inside live layers), no beam search (live layers cannot be
reordered or cropped), full attention layers only (no sliding windows or soft caps).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any, Iterator

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.core.placement import device_guard
from kvtool.formats._live import LiveLayer
from kvtool.formats.base import CompressedCache, Format, FormatParams, get_format, make_params
from kvtool.formats.pipeline import resolve
from kvtool.formats.plan import load_plan
from kvtool.hf import interface as hfinterface
from kvtool.hf.devices import layer_devices
from kvtool.hf.attention import ATTN_NAME, dispatch_through_kvtool, hand_over, handed_over, register_attention, set_prefill_hook, use_kvtool_attention

_state = threading.local()


def _layer_base():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


_LAYER_CLASS: type | None = None


def live_layer_class() -> type:
    """:class:`LiveCacheLayer` (a transformers ``DynamicLayer`` subclass, made on first use so that
    importing kvtool does not import transformers)."""
    global _LAYER_CLASS
    if _LAYER_CLASS is None:
        base = _layer_base()

        class LiveCacheLayer(base):  # type: ignore[misc, valid-type]
            """A transformers cache layer holding a :class:`LiveLayer`. ``update`` hands the new
            tokens to the ``kvtool`` attention function and returns them unchanged;
            ``get_seq_length`` is the number of positions seen (evicted tokens included)."""

            is_croppable = False
            is_compileable = False

            def __init__(self, layer_idx: int, live: LiveLayer, seen: int) -> None:
                super().__init__()
                self.layer_idx, self.live, self.seen = layer_idx, live, int(seen)
                b, h, _, d = live.encoded_shape()
                dtype, device = live.dtype, live.device
                # what generic transformers code reads of a layer (batch size, dtype, device): an empty tensor
                self.keys = torch.empty((b, h, 0, d), dtype=dtype, device=device)
                self.values = self.keys
                self.dtype, self.device = dtype, device
                self.is_initialized = True

            def update(self, key_states, value_states, *args, **kwargs):
                if handed_over(self.layer_idx):
                    raise UsageError(
                        f"layer {self.layer_idx}: the model did not attend through its live cache at the last step (its attention "
                        "implementation does not dispatch through kvtool's: use attn_implementation='sdpa' or 'eager', or "
                        "kvtool.hf.attention.use_kvtool_attention(model))")
                hand_over(self.layer_idx, self, key_states)
                return key_states, value_states

            def attend_layer(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
                """The :class:`LiveLayer` step for new tokens (called by the attention function)."""
                dt = self.dtype
                out = self.live.step(query.to(dt), key.to(dt), value.to(dt), scale)
                self.seen += key.shape[2]
                return out

            def get_seq_length(self) -> int:
                return self.seen

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                return self.seen + query_length, 0

            def get_max_length(self) -> int:
                return -1

            def stored_bytes(self) -> int:
                return self.live.stored_bytes()

            def crop(self, tokens_to_remove: int) -> None:
                raise UsageError("a live compressed cache cannot drop tokens (they are encoded)")

            def batch_repeat_interleave(self, repeats: int) -> None:
                raise UsageError("a live compressed cache cannot be expanded for beam search or several samples per prompt")

            def batch_select_indices(self, indices: torch.Tensor) -> None:
                raise UsageError("a live compressed cache cannot select batch rows")

            def reorder_cache(self, beam_idx: torch.Tensor) -> None:
                raise UsageError("a live compressed cache cannot be reordered for beam search")

            def reset(self) -> None:
                raise UsageError("a live compressed cache cannot be reset; make a new one")

        _LAYER_CLASS = LiveCacheLayer
    return _LAYER_CLASS


def is_live(cache: Any) -> bool:
    """Whether ``cache`` has at least one live layer."""
    cls = live_layer_class()
    return any(isinstance(layer, cls) for layer in getattr(cache, "layers", []))


def stored_bytes(cache: Any) -> int:
    """Bytes the live layers of ``cache`` hold on their devices (encoded tensors and buffers)."""
    cls = live_layer_class()
    return sum(layer.live.stored_bytes() for layer in cache.layers if isinstance(layer, cls))


def live_layers(cache: Any) -> list[LiveLayer]:
    cls = live_layer_class()
    return [layer.live for layer in cache.layers if isinstance(layer, cls)]


def prepare(cache: Any, query_tokens: int = 1) -> None:
    """Host-side work every live layer needs before a step of ``query_tokens`` tokens (call before
    capturing a decode step in a CUDA graph)."""
    for live in live_layers(cache):
        live.prepare(query_tokens)


def reserve(cache: Any, steps: int) -> None:
    """Let every live layer take ``steps`` single-token steps before it next encodes a block eagerly
    (what a loop that replays a captured step needs)."""
    for live in live_layers(cache):
        live.reserve(steps)


def room(cache: Any) -> int:
    """Decode steps every live layer takes before one encodes a block eagerly (host syncs)."""
    return min((live.room() for live in live_layers(cache)), default=1 << 30)


# ----------------------------------------------------------------------------- specs and plans


def resolve_layer_specs(spec: str | Path, num_layers: int | None = None) -> Any:
    """``spec`` -> a function ``layer index -> (Format, FormatParams)``: a format spec (chains
    included) for every layer, or a plan file (``*.json``, :mod:`kvtool.formats.plan`) with a spec
    or a list of per-KV-head specs per layer."""
    text = str(spec)
    if text.endswith(".json") or (isinstance(spec, Path) and spec.suffix == ".json"):
        plan = load_plan(text)
        if num_layers is not None and plan.model.get("num_layers") not in (None, num_layers):
            raise UsageError(f"the plan {text} was made for a model of {plan.model['num_layers']} layers; this model has {num_layers}")
        mixed = get_format("mixed")
        cache: dict[tuple[str, ...], tuple[Format, FormatParams]] = {}

        def of_plan(i: int) -> tuple[Format, FormatParams]:
            specs = tuple(plan.specs_for(i))
            if specs not in cache:
                if len(specs) == 1:
                    fmt, params, _ = resolve(specs[0])
                    cache[specs] = (fmt, params)
                else:
                    cache[specs] = (mixed, make_params(mixed, {"heads": "|".join(specs)}))
            return cache[specs]

        return of_plan
    fmt, params, _ = resolve(text)
    return lambda i: (fmt, params)


# ----------------------------------------------------------------------------- building live caches


def make_live_layer(layer_idx: int, live: LiveLayer, seen: int) -> Any:
    """A transformers cache layer for ``live`` (models attend through it from now on:
    :func:`~kvtool.hf.attention.dispatch_through_kvtool`)."""
    dispatch_through_kvtool()
    return live_layer_class()(layer_idx, live, seen)


def live_cache_from(cc: CompressedCache, model: Any, hold_last: bool = False) -> Any:
    """A live cache (module docstring) from a compressed kvtool object for ``model``: every layer's
    encoded prefix made live on the device of the model's layer ``i`` (``fmt.live_layer``; each
    layer's GPU under a device map), the file's held-out tokens
    appended (all but the last with ``hold_last``). The model is switched to kvtool's attention."""
    from transformers import DynamicCache

    dtype = next(model.parameters()).dtype
    where = layer_devices(model)  # a device map's layers keep their caches beside them
    fmt = cc.fmt
    cache = DynamicCache(config=model.config)
    f = cc.facts
    b = int(cc.token_ids.shape[0])
    for i in range(f.num_layers):
        enc, device = cc.layers[i], where[i]
        like = torch.empty((b, f.num_kv_heads, 0, f.head_dim), dtype=dtype, device=device)
        moved = type(enc)({n: t.to(device) for n, t in enc.tensors.items()}, dict(enc.meta))
        seen = cc.prefix_tokens
        tail = cc.tails.get(i)
        with device_guard(device):  # the format's kernels launch on the current device
            live = fmt.live_layer(moved, like)
            if tail is not None:
                stop = tail.keys.shape[2] - (1 if hold_last else 0)
                if stop > 0:
                    ld = live.dtype
                    live.append(tail.keys[:, :, :stop].to(device, ld), tail.values[:, :, :stop].to(device, ld))
                    seen += stop
        cache.layers[i] = make_live_layer(i, live, seen)
    use_kvtool_attention(model)
    return cache


def compress_hf_cache(cache: Any, spec: str | Path, model: Any = None) -> Any:
    """Compress a transformers cache in place: every dense layer (``DynamicLayer`` with tokens)
    becomes a live layer of ``spec`` (a format spec or a plan file), its dense tensors freed; returns
    the same cache. Formats that read queries (SnapKV eviction, output-aware pruning, plans that
    hold them) cannot: the queries are not in a cache (use :func:`press`, which sees them). With
    ``model`` the model is switched to kvtool's attention (else call :func:`use_kvtool_attention`)."""
    specs = resolve_layer_specs(spec, len(cache.layers))
    cls = live_layer_class()
    done = 0
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, cls) or not getattr(layer, "is_initialized", False) or layer.get_seq_length() == 0:
            continue
        if getattr(layer, "is_sliding", False):
            raise UsageError(f"layer {i} is a sliding-window layer: live compression covers full attention layers only")
        fmt, params = specs(i)
        t = layer.get_seq_length()
        keys, values = layer.keys, layer.values
        try:
            with device_guard(keys.device):
                live = fmt.live_from_dense(LayerKV(keys, values), params)
        except UsageError as exc:
            if "queries" not in str(exc):
                raise
            raise UsageError(f"format {fmt.name} with these parameters reads the queries, which a cache does not hold: "
                             "compress inside `with kvtool.press(...)` instead (it sees the prefill's queries)") from None
        cache.layers[i] = make_live_layer(i, live, t)
        done += 1
    if not done:
        raise UsageError("the cache holds no dense layer with tokens to compress")
    if model is not None:
        use_kvtool_attention(model)
    else:
        register_attention()
    return cache


# ----------------------------------------------------------------------------- press


class _Press:
    """What an active :func:`press` compresses with, and the layers waiting for their queries."""

    def __init__(self, specs: Any) -> None:
        self.specs = specs
        self.pending: dict[int, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.layers = 0


def _pressing() -> _Press | None:
    return getattr(_state, "press", None)


def _compress_now(press: _Press, cache: Any, idx: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None) -> None:
    fmt, params = press.specs(idx)
    live = fmt.live_from_dense(LayerKV(keys, values, queries), params)
    cache.layers[idx] = make_live_layer(idx, live, keys.shape[2])
    press.layers += 1


def _patched_update(original):
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        press = _pressing()
        if press is None:
            return original(self, key_states, value_states, layer_idx, *args, **kwargs)
        if getattr(self, "layer_class_to_replicate", None) is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        fresh = layer is not None and type(layer) is _layer_base() and layer.get_seq_length() == 0
        if not fresh:
            return original(self, key_states, value_states, layer_idx, *args, **kwargs)
        fmt, params = press.specs(layer_idx)
        if fmt.reads_queries(params):
            # compressed by the attention function once it has this prefill's queries
            press.pending[layer_idx] = (self, key_states, key_states, value_states)
        else:
            _compress_now(press, self, layer_idx, key_states, value_states, None)
        return key_states, value_states

    return update


def press_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Called by the ``kvtool`` attention function after a prefill's attention: a layer that waits
    for its queries is compressed now (``query`` ``[B, H, T, D]`` after RoPE)."""
    press = _pressing()
    if press is None or not press.pending:
        return
    idx = getattr(module, "layer_idx", None)
    item = press.pending.get(idx)
    if item is None or item[1] is not key:
        return
    del press.pending[idx]
    cache, _, keys, values = item
    _compress_now(press, cache, idx, keys, values, query)


@contextlib.contextmanager
def press(spec: str | Path, model: Any = None) -> Iterator[_Press]:
    """Compress prompts' caches in place as they are filled, kvpress-style (module docstring)::

        with kvtool.press("bitmap:sparsity=0.7"):
            out = model.generate(ids, max_new_tokens=64)

    ``spec``: a format spec (``quant:bits=4``, chains ``snapkv:budget=512+quant:bits=4``) or a plan
    file (``plan.json`` from ``kvtool recommend``). Within the block every transformers model that
    dispatches attention by name (SDPA, the default) attends through kvtool's function, which is
    SDPA for every cache that is not live (:func:`~kvtool.hf.attention.dispatch_through_kvtool`);
    ``model``: also switch that model's attention to it explicitly. Yields an object whose ``layers``
    counts the layers compressed."""
    from transformers.cache_utils import Cache

    num_layers = int(model.config.num_hidden_layers) if model is not None else None
    state = _Press(resolve_layer_specs(spec, num_layers))
    if _pressing() is not None:
        raise UsageError("kvtool.press blocks do not nest")
    register_attention()
    original = Cache.update
    _state.press = state
    Cache.update = _patched_update(original)  # type: ignore[method-assign]
    dispatch_through_kvtool()
    set_prefill_hook(press_attention)
    previous = hfinterface.set_attention(model, ATTN_NAME) if model is not None else None
    try:
        yield state
    finally:
        Cache.update = original  # type: ignore[method-assign]
        set_prefill_hook(None)
        _state.press = None
        if model is not None and previous not in (None, ATTN_NAME):
            try:
                hfinterface.set_attention(model, previous)
            except (KeyError, ValueError):
                model.config._attn_implementation = previous
