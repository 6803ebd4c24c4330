"""Running a transformers model on a compressed prefix: formats applied inside attention.

A compressed file holds, for some model layers, the first ``P`` tokens' cache in a format (some
formats *select* tokens per query rather than shrink them, so no dense cache can stand in for them).
This module lets a real model continue after that prefix:

kvtool has one attention function in transformers' ``AttentionInterface``, ``kvtool``. A layer
attends through a compressed *source* when one is given, else it is the model's SDPA attention:

- :func:`compressed_attention` (a context manager) switches the model to ``kvtool`` with a
  :class:`CompressedPrefix` as the source of its layers; :func:`hand_over` lets a cache layer's
  ``update`` name the source for the call that follows (the caches of :mod:`kvtool.hf.cache`: a
  prefix, or a format's ring buffer). In a layer that has an encoded prefix, the new tokens' queries ``[B, H, Tq, D]`` attend to the prefix
  through ``fmt.attend`` (or ``fmt.attend_kernel`` with ``backend="triton"``), a partial
  ``(out, lse)``, and to the dense tokens after the prefix (``cache[P:]``: the continuation so far,
  causal) with plain attention; the two partials merge exactly (:func:`kvtool.core.attention.merge_partials`).
  Other layers run transformers' SDPA attention over their dense cache unchanged.
- :func:`build_cache` makes the ``DynamicCache`` the model continues from: ``P`` dense tokens for
  layers without an encoded prefix and a zero placeholder of ``P`` tokens for layers with one (the
  placeholder only keeps positions and lengths right; it is never read while the context manager is
  active, and reading it without the context manager gives visibly wrong output, never silently
  dense output).
- :func:`prefill` runs the model on the prefix ids to get every layer's dense prefix (for the layers
  a file does not hold), :func:`forward` runs new tokens, :func:`greedy` decodes greedily.

Example (``cc`` a :class:`~kvtool.formats.base.CompressedCache` of ``model``)::

    prefix = CompressedPrefix.from_compressed(cc)
    dense = prefill(model, cc.token_ids[:, :cc.prefix_tokens])
    cache = build_cache(model, dense, prefix)
    with compressed_attention(model, prefix):
        logits = forward(model, cache, cc.token_ids[:, cc.prefix_tokens:])   # [B, W, V]
        tokens = greedy(model, cache, logits[:, -1], 16)                    # [B, 16]

A model spread over several GPUs by a device map (accelerate) keeps layer ``i``'s cache and encoded
prefix on layer ``i``'s device (:func:`kvtool.hf.devices.layer_devices`); the attention function
makes that device current while a layer attends through its source (Triton kernels launch on the
current device).

Padding: a source may accept an attention mask that hides tokens from the last query (left padding,
:func:`masks_tokens`) through its ``check_padding(mask)``: a live layer built from a left-padded
prompt (:class:`~kvtool.formats._rows.RowsLive`) holds no pad tokens and checks that the mask hides
exactly the pads it dropped (:func:`left_pads`). A :class:`CompressedPrefix` (a file's encoding,
pads included) refuses a padded batch with a UsageError before its first token. Limits: no
sliding-window or soft-capped attention in compressed layers, no output_attentions.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from kvtool.hf import devices as hfdevices
from kvtool.hf import interface as hfinterface
from kvtool.core.attention import attend_partial, merge_partials
from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.core.placement import device_guard
from kvtool.formats.base import CompressedCache, Encoded, Format

ATTN_NAME = "kvtool"

_state = threading.local()


@dataclass
class CompressedPrefix:
    """What the attention function needs: the format, the encoded prefix per model layer index,
    the prefix length ``P`` in tokens, and the backend (``"torch"``: ``fmt.attend``; ``"triton"``:
    ``fmt.attend_kernel``)."""

    fmt: Format
    layers: dict[int, Encoded]
    prefix_tokens: int
    backend: str = "torch"

    @classmethod
    def from_compressed(cls, cc: CompressedCache, layers: list[int] | None = None, backend: str = "torch") -> "CompressedPrefix":
        """All layers of ``cc`` (or the given subset)."""
        chosen = cc.layer_indices if layers is None else [i for i in layers if i in cc.layers]
        return cls(cc.fmt, {i: cc.layers[i] for i in chosen}, cc.prefix_tokens, backend)

    def to(self, device: torch.device | str | Mapping[int, torch.device]) -> "CompressedPrefix":
        """A copy with every encoded tensor on ``device``, or layer ``i``'s on ``device[i]`` (a
        model's :func:`~kvtool.hf.devices.layer_devices`)."""
        where = device if isinstance(device, Mapping) else {i: device for i in self.layers}
        moved = {i: Encoded({n: t.to(where[i]) for n, t in e.tensors.items()}, e.meta) for i, e in self.layers.items()}
        return CompressedPrefix(self.fmt, moved, self.prefix_tokens, self.backend)

    def attend_layer(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """:func:`compressed_layer_attention` on this prefix."""
        return compressed_layer_attention(self, layer, query, key, value, scale)


def compressed_layer_attention(
    prefix: CompressedPrefix,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """Attention output ``[B, H, Tq, D]`` float32 of ``query`` ``[B, H, Tq, D]`` for one layer.

    ``key``/``value`` ``[B, Hkv, P + R, D]`` are the layer's cache including the new tokens; their
    first P positions are ignored (the encoded prefix replaces them); the last R are dense and
    attended causally (query i, the (R - Tq + i)-th recent token, sees recent tokens 0..R - Tq + i)."""
    p = prefix.prefix_tokens
    enc = prefix.layers[layer]
    if prefix.backend == "triton":
        part_prefix = prefix.fmt.attend_kernel(kernel_query(query, enc), enc, scale)
    else:
        part_prefix = prefix.fmt.attend(query, enc, scale)
    recent_k, recent_v = key[:, :, p:], value[:, :, p:]
    tq, r = query.shape[2], recent_k.shape[2]
    if r < tq:
        raise UsageError(f"layer {layer}: the cache holds {r} tokens after the prefix, fewer than the {tq} new queries")
    mask = torch.ones(tq, r, dtype=torch.bool, device=query.device).tril(diagonal=r - tq)
    part_recent = attend_partial(query, recent_k, recent_v, scale, mask)
    out, _ = merge_partials((part_prefix[0].float(), part_prefix[1].float()), part_recent)
    return out


def kernel_query(query: torch.Tensor, enc: Encoded) -> torch.Tensor:
    """``query`` in the dtype of the encoded layer (its ``meta["dtype"]``), which the kernels ask of
    q: the model may compute in another one (float32 on the CPU over a float16 capture)."""
    want = getattr(torch, str(enc.meta.get("dtype")), None)
    return query.to(want) if isinstance(want, torch.dtype) and want.is_floating_point and query.dtype != want else query


def handed_over(layer: int) -> bool:
    """Whether a hand-over of ``layer`` is still waiting for its attention call (a model that does
    not attend through kvtool's function never takes it)."""
    return layer in getattr(_state, "pending", {})


def clear_handovers() -> None:
    """Drop hand-overs no attention call took (after an interrupted forward)."""
    _state.pending = {}


def hand_over(layer: int, source: Any, key: torch.Tensor) -> None:
    """Called by a cache layer's ``update``: the next attention call of ``layer`` whose keys are
    ``key`` attends through ``source`` (an object with ``attend_layer(layer, query, key, value,
    scale)``: a :class:`CompressedPrefix`, or a format's ring buffer)."""
    if not hasattr(_state, "pending"):
        _state.pending = {}
    _state.pending[layer] = (source, key)


def _source_for(layer: int | None, key: torch.Tensor) -> Any:
    """What layer ``layer`` attends through: what its cache handed over for these keys, else the
    prefix of :func:`compressed_attention` when it covers the layer and the keys reach past it."""
    pending = getattr(_state, "pending", {}).pop(layer, None)
    if pending is not None and pending[1] is key:
        return pending[0]
    prefix: CompressedPrefix | None = getattr(_state, "prefix", None)
    if prefix is not None and layer in prefix.layers and key.shape[2] > prefix.prefix_tokens:
        return prefix
    return None


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any):
    """The transformers attention function ``kvtool``: a layer with a compressed source attends
    through it; every other layer (and every other call) is the model's SDPA attention (after which
    an active ``kvtool.press`` may compress the layer it just filled, :func:`set_prefill_hook`). A
    positional ``dropout`` after the mask, as wrappers such as kvpress's pass it, is accepted."""
    dense = kwargs.pop("_dense", None)
    if args:
        kwargs.setdefault("dropout", args[0])
    idx = getattr(module, "layer_idx", None)
    source = _source_for(idx, key)
    if source is not None and (getattr(source, "padded", False) or masks_tokens(attention_mask)):
        check = getattr(source, "check_padding", None)  # a live layer knows the pads it dropped; a file's prefix holds them
        try:
            if check is None:
                raise UsageError(PADDING)
            check(attention_mask)
        except UsageError:
            clear_handovers()
            raise
    if source is None:
        if dense is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as dense
        result = dense(module, query, key, value, attention_mask, **kwargs)
        hook = getattr(_state, "prefill_hook", None)
        if hook is not None:
            with device_guard(query.device):
                hook(module, query, key, value, attention_mask)
        return result
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise UsageError(f"layer {idx}: soft-capped or sliding-window attention is not supported on a compressed prefix")
    with device_guard(query.device):  # a layer on another GPU than the current one (a device map)
        out = source.attend_layer(idx, query, key, value, kwargs.get("scaling"))
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


PADDING = ("a padded batch (an attention mask that hides tokens, e.g. left padding) cannot attend to a compressed file's prefix: "
           "its encoding holds the pad tokens with the others; generate each prompt on its own, or compress the padded prompts inside "
           "kvtool.press, whose live layers drop each row's pads")


def _hidden(mask: torch.Tensor) -> torch.Tensor:
    """Bool, True where a transformers attention mask (bool, True = attend; additive float; or
    0 / 1 integers) hides a key."""
    if mask.dtype == torch.bool:
        return ~mask
    return mask < torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask == 0


def masks_tokens(mask: Any) -> bool:
    """Whether a transformers attention mask (bool, True = attend, or additive float; ``[B, 1, Tq,
    Tk]``) hides a token from the last query: padding (a causal mask hides nothing from it)."""
    if not isinstance(mask, torch.Tensor) or mask.ndim < 2 or mask.numel() == 0:
        return False
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # reading the mask is a host sync, which a CUDA graph capture forbids; the eager steps before it checked
    return bool(_hidden(mask[..., -1, :]).any())


def left_pads(mask: torch.Tensor, batch: int) -> list[int]:
    """Per row, the keys a transformers attention mask ``[B or 1, 1, Tq, Tk]`` hides from the last
    query: left padding, so they must be the row's first ones (UsageError otherwise: right padding,
    or holes that no live format can drop)."""
    hidden = _hidden(mask[..., -1, :])
    hidden = hidden.reshape(hidden.shape[0], -1, hidden.shape[-1])[:, 0].expand(batch, -1).cpu()
    counts = hidden.sum(-1)
    prefix = torch.arange(hidden.shape[-1])[None, :] < counts[:, None]
    if not torch.equal(hidden, prefix):
        raise UsageError("the attention mask hides tokens that are not a row's first ones (right padding, or holes): live compressed "
                         "caches take left padding only (tokenizer.padding_side = 'left')")
    return [int(c) for c in counts]


def set_prefill_hook(hook: Any) -> None:
    """``hook(module, query, key, value, attention_mask)`` runs after every dense (SDPA) attention
    call through kvtool's function in this thread (None: no hook). ``kvtool.press`` compresses each
    prompt layer with it (it sees the prefill's queries and, in a padded batch, the mask)."""
    _state.prefill_hook = hook


_DISPATCHING: dict[str, Any] = {}


def restore_dispatch() -> None:
    """Give transformers back its own ``sdpa`` and ``eager`` functions (the outermost
    ``kvtool.press`` does on exit; a live cache in use routes them through kvtool again)."""
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    for name, original in list(_DISPATCHING.items()):
        if original is _eager_of:
            mapping.pop(name, None)
        else:
            mapping[name] = original
        del _DISPATCHING[name]


def dispatch_through_kvtool() -> bool:
    """Route transformers' ``sdpa`` and ``eager`` attention of every model through kvtool's function,
    which calls the original one for every layer without a compressed source (a mapping lookup per
    call) and the layer's live cache for the others; done once per process, the first time a live
    cache is made, so that a live cache attends right in any model that dispatches attention by
    name, without switching the model's implementation. ``kvtool.press`` relies on it too.
    Returns whether this call routed them (False: they already were)."""
    if _DISPATCHING:
        return False
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    register_attention()
    mapping = AttentionInterface._global_mapping
    for name in ("sdpa", "eager"):
        original = mapping.get(name)
        if original is None:  # eager attention is each model's own function: found at call time
            original = _eager_of
        elif name == "sdpa" and original is not sdpa_attention_forward and getattr(original, "__name__", "") == "kvtool_dispatch":
            continue

        def kvtool_dispatch(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, *args: Any, _original=original, **kwargs: Any):
            return _attention(module, query, key, value, attention_mask, *args, _dense=_original, **kwargs)

        _DISPATCHING[name] = original
        mapping[name] = kvtool_dispatch
    return True


def _eager_of(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any):
    """The eager attention of ``module``'s model (its modeling file's ``eager_attention_forward``)."""
    import sys

    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
    return fn(module, query, key, value, attention_mask, **kwargs)


def use_kvtool_attention(model: Any) -> None:
    """Register ``kvtool`` with transformers and switch ``model`` to it for good (caches that hand
    over a compressed source need it; without one it is SDPA)."""
    register_attention()
    hfinterface.set_attention(model, ATTN_NAME)


def register_attention() -> None:
    """Register ``kvtool`` (attention and its SDPA-style mask) with transformers."""
    hfinterface.register_attention(ATTN_NAME, _attention)


@contextlib.contextmanager
def compressed_attention(model: Any, prefix: CompressedPrefix | None) -> Iterator[None]:
    """Within the block, ``model``'s layers in ``prefix.layers`` attend to the encoded prefix (see
    the module docstring). ``prefix=None`` runs every layer densely through the same machinery.
    The model's previous attention implementation is restored on exit."""
    register_attention()
    before = getattr(_state, "prefix", None)
    _state.prefix = prefix
    try:
        with hfinterface.attention_implementation(model, ATTN_NAME):
            yield
    finally:
        _state.prefix = before


@torch.no_grad()
def prefill(model: Any, prefix_ids: torch.Tensor) -> dict[int, LayerKV]:
    """Run ``model`` on ``prefix_ids`` ``[B, P]`` (dense attention) and return every layer's cache:
    keys/values ``[B, Hkv, P, D]`` in the model's dtype, on the model's device."""
    device = next(model.parameters()).device
    out = model(input_ids=prefix_ids.to(device), use_cache=True)
    cache = hfinterface.output_cache(out)
    return {i: LayerKV(keys=layer.keys, values=layer.values) for i, layer in enumerate(cache.layers)}


def build_cache(model: Any, dense: dict[int, LayerKV], prefix: CompressedPrefix | None = None) -> Any:
    """A fresh ``DynamicCache`` of P tokens for every model layer: ``dense[i]`` for layers not in
    ``prefix.layers``, a zero placeholder of the same shape for layers in it. ``dense`` must cover
    every layer that is not compressed (:func:`prefill` gives all of them). Tensors are copied onto
    the device of the model's layer (:func:`~kvtool.hf.devices.layer_devices`: one device, or each
    layer's GPU under a device map), so the same ``dense`` can seed several runs."""
    from transformers import DynamicCache

    n = int(model.config.num_hidden_layers)
    compressed = set(prefix.layers) if prefix is not None else set()
    missing = [i for i in range(n) if i not in compressed and i not in dense]
    if missing:
        raise UsageError(f"layer {missing[0]} has neither an encoded nor a dense prefix")
    ref = next(iter(dense.values())) if dense else None
    where = hfdevices.layer_devices(model)  # each layer's cache lives where that layer computes
    data = []
    for i in range(n):
        device = where[i]
        if i in compressed:
            like = dense.get(i) or ref
            if like is None:
                raise UsageError("build_cache needs at least one dense layer to shape the placeholders")
            shape = list(like.keys.shape)
            shape[2] = prefix.prefix_tokens
            data.append((like.keys.new_zeros(shape, device=device), like.values.new_zeros(shape, device=device)))
        else:
            data.append((dense[i].keys.to(device, copy=True), dense[i].values.to(device, copy=True)))
    try:
        return DynamicCache(ddp_cache_data=data, config=model.config)
    except TypeError:
        return DynamicCache(data)


@torch.no_grad()
def forward(model: Any, cache: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """Run ``token_ids`` ``[B, N]`` after the tokens already in ``cache`` (positions continue from
    the cache length) and return logits ``[B, N, V]`` float32 on the CPU. ``cache`` grows by N."""
    device = next(model.parameters()).device
    out = model(input_ids=token_ids.to(device), use_cache=True, **hfinterface.cache_kwargs(model, cache))
    return out.logits.float().cpu()


@torch.no_grad()
def greedy(model: Any, cache: Any, last_logits: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding of ``steps`` tokens ``[B, steps]`` int64, starting from the next-token logits
    ``[B, V]`` of the last token already in ``cache``."""
    tokens: list[torch.Tensor] = []
    nxt = last_logits.argmax(-1, keepdim=True)
    for step in range(steps):
        tokens.append(nxt.cpu())
        if step + 1 < steps:
            logits = forward(model, cache, nxt)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(tokens, dim=1) if tokens else torch.zeros(last_logits.shape[0], 0, dtype=torch.int64)
