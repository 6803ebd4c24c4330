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

A cache with live layers gains ``stored_bytes()``, ``dense_bytes(dtype=...)``, ``storage_ratio`` and
``held_tokens()`` (:class:`LiveCacheMixin`). Presses in several threads are independent.

Padded batches: a left-padded prompt with its attention mask, pressed (or a padded cache given to
:func:`compress_hf_cache` with the prompt's mask), becomes per-row live layers over each row's real
tokens (:class:`~kvtool.formats._rows.RowsLive`): each row holds and generates what it would alone.
A live cache that kept every position (``compress_hf_cache`` without the mask, ``live_cache_from``)
refuses a mask that hides tokens, and any live layer refuses a mask that is not left padding or
hides other tokens than the pads it dropped, with a UsageError before the step it would attend wrong. Limits: no beam search (live layers cannot
be reordered or cropped), full attention layers only (no sliding windows or soft caps).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.core.placement import device_guard
from kvtool.formats._live import LiveLayer
from kvtool.formats._rows import RowsLive
from kvtool.formats.base import CompressedCache, Format, FormatParams, get_format, make_params
from kvtool.formats.pipeline import resolve
from kvtool.formats.plan import load_plan, note_default_layers
from kvtool.hf import interface as hfinterface
from kvtool.hf.devices import layer_devices
from kvtool.hf.attention import (ATTN_NAME, dispatch_through_kvtool, hand_over, handed_over, left_pads, masks_tokens, register_attention,
                                 restore_dispatch, set_prefill_hook, use_kvtool_attention)

_state = threading.local()


def _layer_base():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


_LAYER_CLASS: type | None = None
NO_NEW_TOKENS = ("input_ids holds no token after the cache's: give model.generate the cached tokens followed by the new ones "
                 "(kvtool.continuation_ids(path, new_ids) builds them), not the new ones alone")


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
                dispatch_through_kvtool()  # a press that exited may have restored transformers' functions
                hand_over(self.layer_idx, self, key_states)
                return key_states, value_states

            def attend_layer(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
                """The :class:`LiveLayer` step for new tokens (called by the attention function)."""
                dt = self.dtype
                out = self.live.step(query.to(dt), key.to(dt), value.to(dt), scale)
                self.seen += key.shape[2]
                return out

            @property
            def padded(self) -> bool:
                """Whether the layer dropped left pads at its prefill (every step's mask is checked)."""
                return any(getattr(self.live, "pads", ()))

            def check_padding(self, mask: Any) -> None:
                """UsageError unless ``mask`` hides from each row exactly the left pads the live
                layer dropped when it was built (a padded prompt compressed by :func:`press`). No
                mask (transformers gives none when it hides nothing) and a step being captured in a
                CUDA graph (no host reads) are not checked."""
                if not isinstance(mask, torch.Tensor) or mask.ndim < 2 or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
                    return
                b = self.keys.shape[0]
                want = list(getattr(self.live, "pads", [0] * b))
                got = left_pads(mask, b)
                if got == want:
                    return
                if not any(want):
                    raise UsageError(
                        f"layer {self.layer_idx}: a padded batch (the attention mask hides the first {got} tokens of the rows) needs "
                        "a live cache built from the padded prompts inside kvtool.press, whose layers drop each row's pads (or "
                        "kvtool.hf.live.compress_hf_cache(cache, spec, attention_mask=mask)); this cache holds every position of "
                        "every row (kvtool.compress of a cache without the mask, to_hf_cache of a file)")
                raise UsageError(f"layer {self.layer_idx}: the attention mask hides the first {got} tokens of the rows, but this live "
                                 f"cache dropped {want} pad tokens at its prefill: keep the padded prompt's attention mask")

            def get_seq_length(self) -> int:
                return self.seen

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                if query_length == 0:
                    raise UsageError(NO_NEW_TOKENS)
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


class LiveCacheMixin:
    """What a transformers cache with live layers tells of its size (the cache's class gains it
    when its first layer goes live, :func:`make_live_cache`). One definition everywhere, shared
    with ``kvtool compress``'s ``storage_ratio``: the bytes held over the bytes of a dense cache of
    the same positions (keys and values, every layer, evicted tokens included) in the serving dtype,
    full-precision parts counted in that dtype (a live cache holds them in its own dtype: the
    model's after a press, the file's after ``to_hf_cache``)."""

    def stored_bytes(self) -> int:
        """Bytes the cache holds on its devices: every live layer's encoded tensors and buffers
        (capacity included), and the keys / values of any layer that is not live."""
        cls = live_layer_class()
        total = 0
        for layer in self.layers:  # type: ignore[attr-defined]
            if isinstance(layer, cls):
                total += layer.live.stored_bytes()
            elif getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor):
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total

    def dense_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of a dense cache of the same positions: 2 (keys, values) x B x Hkv x positions x D
        per layer, in ``dtype`` (default: the cache's own dtype)."""
        cls = live_layer_class()
        total = 0
        for layer in self.layers:  # type: ignore[attr-defined]
            if isinstance(layer, cls):
                b, h, _, d = layer.live.encoded_shape()
                t, dt = layer.seen, dtype or layer.dtype
            elif getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor) and layer.keys.ndim == 4:
                b, h, t, d = layer.keys.shape
                dt = dtype or layer.keys.dtype
            else:
                continue
            total += 2 * b * h * t * d * dt.itemsize
        return total

    @property
    def storage_ratio(self) -> float:
        """:meth:`stored_bytes` / :meth:`dense_bytes` in the cache's dtype (a fraction)."""
        dense = self.dense_bytes()
        return self.stored_bytes() / dense if dense else float("nan")

    def held_tokens(self) -> int:
        """Tokens the first live layer attends to (fewer than :meth:`get_seq_length`, the positions
        seen, where a format evicts)."""
        cls = live_layer_class()
        return next((layer.live.tokens for layer in self.layers if isinstance(layer, cls)), 0)  # type: ignore[attr-defined]


_LIVE_CACHE_CLASSES: dict[type, type] = {}


def make_live_cache(cache: Any) -> Any:
    """Give ``cache`` (a transformers ``Cache``) the methods of :class:`LiveCacheMixin` (its class
    becomes a subclass of its own class and the mixin); returns it."""
    if isinstance(cache, LiveCacheMixin):
        return cache
    cls = type(cache)
    if cls not in _LIVE_CACHE_CLASSES:
        _LIVE_CACHE_CLASSES[cls] = type(f"Live{cls.__name__}", (LiveCacheMixin, cls), {"__module__": __name__})
    cache.__class__ = _LIVE_CACHE_CLASSES[cls]
    return cache


def is_live(cache: Any) -> bool:
    """Whether ``cache`` has at least one live layer."""
    cls = live_layer_class()
    return any(isinstance(layer, cls) for layer in getattr(cache, "layers", []))


def stored_bytes(cache: Any) -> int:
    """Bytes the live layers of ``cache`` hold on their devices (encoded tensors and buffers); the
    cache's own :meth:`LiveCacheMixin.stored_bytes` counts its dense layers too."""
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

        checked: list[tuple[int, int, int]] = []

        def check(layers: int, kv_heads: int, head_dim: int) -> None:
            """The checks ``compress --plan`` makes (:meth:`Plan.check`), once per model shape;
            layers the plan does not list are named on stderr (they use its default)."""
            if (layers, kv_heads, head_dim) in checked:
                return
            facts = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
            plan.check(facts, list(range(layers)))  # type: ignore[arg-type]
            note_default_layers(plan, list(range(layers)), text)
            checked.append((layers, kv_heads, head_dim))

        of_plan.check = check  # type: ignore[attr-defined]
        return of_plan
    fmt, params, _ = resolve(text)
    return lambda i: (fmt, params)


def check_specs(specs: Any, layers: int, kv_heads: int, head_dim: int) -> None:
    """A plan's checks against a model's shape (nothing for a single spec)."""
    check = getattr(specs, "check", None)
    if check is not None:
        check(layers, kv_heads, head_dim)


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
    return make_live_cache(cache)


def compress_hf_cache(cache: Any, spec: str | Path, model: Any = None, attention_mask: torch.Tensor | None = None) -> Any:
    """Compress a transformers cache in place: every dense layer (``DynamicLayer`` with tokens)
    becomes a live layer of ``spec`` (a format spec or a plan file), its dense tensors freed; returns
    the same cache. Formats that read queries (SnapKV eviction, output-aware pruning, plans that
    hold them) cannot: the queries are not in a cache (use :func:`press`, which sees them). With
    ``model`` the model is switched to kvtool's attention (else call :func:`use_kvtool_attention`).
    ``attention_mask`` ``[B, T]`` (1 = real token; the prompt's mask of a left-padded batch): each
    row's layer holds its tokens after its pads alone (:class:`RowsLive`)."""
    specs = resolve_layer_specs(spec, len(cache.layers))
    pads = None
    if attention_mask is not None:
        pads = left_pads(attention_mask[:, None, None, :].bool(), int(attention_mask.shape[0]))
    cls = live_layer_class()
    first = next((layer for layer in cache.layers if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.ndim == 4), None)
    if first is not None:
        check_specs(specs, len(cache.layers), int(first.keys.shape[1]), int(first.keys.shape[3]))
    done = 0
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, cls) or not getattr(layer, "is_initialized", False) or layer.get_seq_length() == 0:
            continue
        if getattr(layer, "is_sliding", False):
            raise UsageError(f"layer {i} is a sliding-window layer: live compression covers full attention layers only")
        fmt, params = specs(i)
        t = layer.get_seq_length()
        keys, values = layer.keys, layer.values
        if pads is not None and (len(pads) != keys.shape[0] or attention_mask.shape[-1] != t):
            raise UsageError(f"attention_mask {tuple(attention_mask.shape)} does not match layer {i}'s {keys.shape[0]} rows of {t} tokens")
        try:
            with device_guard(keys.device):
                if pads is not None and any(pads):
                    live = RowsLive.from_dense(fmt, LayerKV(keys, values), params, pads)
                else:
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
    make_live_cache(cache)
    if model is not None:
        use_kvtool_attention(model)
    else:
        register_attention()
    return cache


# ----------------------------------------------------------------------------- press


class _Press:
    """What an active :func:`press` compresses with, and the prompt layers waiting for their
    attention call (layer index -> (cache, keys, values))."""

    def __init__(self, specs: Any, num_layers: int | None = None) -> None:
        self.specs = specs
        self.num_layers = num_layers
        self.pending: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.layers = 0


# Cache.update and the sdpa / eager attention functions are process-wide: the first active press
# (of any thread) patches them, the last one to exit restores them; each thread's press is its own.
_PATCH_LOCK = threading.Lock()
_PATCH: dict[str, Any] = {"active": 0, "original": None, "dispatched": False}
NOT_DISPATCHED = ("the model did not attend through kvtool's attention function at its prefill (its attention implementation "
                  "does not dispatch through kvtool's: use attn_implementation='sdpa' or 'eager', or kvtool.hf.attention.use_kvtool_attention(model))")


def _pressing() -> _Press | None:
    return getattr(_state, "press", None)


def _compress_now(press: _Press, cache: Any, idx: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
                  pads: list[int] | None = None) -> None:
    """Layer ``idx`` of ``cache`` becomes live: the format's layer of ``keys`` / ``values`` ``[B,
    Hkv, T, D]`` (``queries`` ``[B, H, T, D]`` for formats that read them), or, where rows have
    left pads (``pads[b]`` tokens), one layer per row over its real tokens (:class:`RowsLive`)."""
    fmt, params = press.specs(idx)
    layer = LayerKV(keys, values, queries if fmt.reads_queries(params) else None)
    if pads is not None and any(pads):
        live = RowsLive.from_dense(fmt, layer, params, pads)
    else:
        live = fmt.live_from_dense(layer, params)
    cache.layers[idx] = make_live_layer(idx, live, keys.shape[2])
    make_live_cache(cache)
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
        stale = press.pending.pop(layer_idx, None)
        if stale is not None and stale[0] is self:  # this cache's prompt layer never reached kvtool's attention
            press.pending.clear()
            raise UsageError(f"layer {layer_idx}: {NOT_DISPATCHED}")
        layers = press.num_layers or (len(self.layers) if getattr(self, "layer_class_to_replicate", None) is None else None)
        if layers:
            check_specs(press.specs, layers, int(key_states.shape[1]), int(key_states.shape[3]))
        press.specs(layer_idx)  # a plan's format for the layer resolves (and fails) here, before the attention
        # compressed by the attention function once it ran on the prompt: it has the queries and the mask
        press.pending[layer_idx] = (self, key_states, value_states)
        return key_states, value_states

    return update


def press_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any = None) -> None:
    """Called by the ``kvtool`` attention function after a prefill's attention: the layer waiting
    for it is compressed now (``query`` ``[B, H, T, D]`` after RoPE; ``mask`` the model's attention
    mask: a left-padded batch's rows drop their pads, :func:`~kvtool.hf.attention.left_pads`)."""
    press = _pressing()
    if press is None or not press.pending:
        return
    idx = getattr(module, "layer_idx", None)
    item = press.pending.get(idx)
    if item is None or item[1] is not key:
        return
    del press.pending[idx]
    cache, keys, values = item
    pads = left_pads(mask, keys.shape[0]) if masks_tokens(mask) else None
    _compress_now(press, cache, idx, keys, values, query, pads)


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

    if _pressing() is not None:
        raise UsageError("kvtool.press blocks do not nest (in one thread)")
    num_layers = int(model.config.num_hidden_layers) if model is not None else None
    state = _Press(resolve_layer_specs(spec, num_layers), num_layers)
    if model is not None:
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        check_specs(state.specs, num_layers, int(getattr(cfg, "num_key_value_heads", None) or heads),
                    int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads))
    register_attention()
    with _PATCH_LOCK:
        if not _PATCH["active"]:
            _PATCH["original"] = Cache.update
            Cache.update = _patched_update(_PATCH["original"])  # type: ignore[method-assign]
            _PATCH["dispatched"] = dispatch_through_kvtool()
        _PATCH["active"] += 1
    _state.press = state
    set_prefill_hook(press_attention)
    previous = hfinterface.set_attention(model, ATTN_NAME) if model is not None else None
    try:
        yield state
    finally:
        set_prefill_hook(None)
        _state.press = None
        with _PATCH_LOCK:
            _PATCH["active"] -= 1
            if not _PATCH["active"]:
                Cache.update = _PATCH["original"]  # type: ignore[method-assign]
                if _PATCH["dispatched"]:
                    restore_dispatch()
        if model is not None and previous not in (None, ATTN_NAME):
            try:
                hfinterface.set_attention(model, previous)
            except (KeyError, ValueError):
                model.config._attn_implementation = previous
