"""The ``bitmap`` format (Mustafar): per-token magnitude pruning (or another method of
:mod:`kvtool.methods.prune`) of keys and values, stored as 64-element tiles with a 64-bit bitmap each,
packed non-zeros and one offset per block of 64 tokens; the most recent ``dense_window`` tokens stay
dense. Layout: :mod:`kvtool.kernels.bitmap_layout` and docs/formats.md (section ``bitmap``).

Stored tensors per layer (B batch, Hkv KV heads, T tokens, W window, Tc = T - W, D head_dim,
NB = ceil(Tc / 64), DT = ceil(D / 64)), layout version 2 (layer metadata ``layout_version``):

- ``keys.nz`` / ``values.nz``: 1-D, cache dtype, packed stored elements;
- ``keys.bitmaps`` int64 ``[B, Hkv, Tc, DT]`` (token tiles); ``values.bitmaps`` int64
  ``[B, Hkv, NB, D]`` (channel tiles of 64 tokens);
- ``keys.offsets`` / ``values.offsets`` int64 ``[B * Hkv * NB + 1]``;
- ``window.keys`` / ``window.values`` ``[B, Hkv, W, D]`` cache dtype.

Version-1 layers (no ``layout_version``: keys as channel tiles, values as token tiles) still decode
as stored; the kernel path converts them to version 2 on load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtool.core.attention import attend_partial
from kvtool.formats._live import LiveLayer, on_gpu
from kvtool.core.cache import KVCache, LayerKV, dtype_name
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.limits import LIVE_HEADROOM
from kvtool.core.selection import keep_count
from kvtool.formats.base import CompressedCache, Encoded, Format, FormatParams, register
from kvtool.kernels.bitmap_prune_encode import can_run_cuda, prune_encode
from kvtool.kernels.common import interpreting
from kvtool.kernels.bitmap_layout import LAYOUT_V1, LAYOUT_V2, ORIENTATIONS, TILE, BitmapCache, BitmapTensor, append_blocks, growable_cache, popcount64
from kvtool.kernels.bitmap_sparse_attention import bitmap_sparse_attention, convert_layout, encode_cache_v2, prepare_attention
from kvtool.methods.prune import DEFAULT_WINDOW, QUERY_METHODS, check_sparsity, parse_method, prune_layer

ENCODE_BACKENDS = ("auto", "torch", "triton", "cuda")
PARTS = ("nonzeros", "bitmaps", "offsets", "padding", "dense_window")


@dataclass
class BitmapParams(FormatParams):
    """``sparsity`` sets keys and values; ``key_sparsity`` / ``value_sparsity`` override it.
    ``method``: a :mod:`kvtool.methods.prune` method or KEYS/VALUES. ``dense_window``: recent tokens kept
    dense."""

    sparsity: float = 0.7
    key_sparsity: float | None = None
    value_sparsity: float | None = None
    method: str = "per-token"
    dense_window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        check_sparsity(self.sparsity, "--sparsity")
        if self.key_sparsity is not None:
            check_sparsity(self.key_sparsity, "--key-sparsity")
        if self.value_sparsity is not None:
            check_sparsity(self.value_sparsity, "--value-sparsity")
        parse_method(self.method)
        if self.dense_window < 0:
            raise UsageError(f"--dense-window must be at least 0, got {self.dense_window}")

    @property
    def keys(self) -> float:
        return self.sparsity if self.key_sparsity is None else self.key_sparsity

    @property
    def values(self) -> float:
        return self.sparsity if self.value_sparsity is None else self.value_sparsity


def cache_from_encoded(enc: Encoded) -> BitmapCache:
    """The :class:`BitmapCache` view of an encoded layer (no copy). BadDataError if a tensor or a
    metadata field is missing."""
    need = ("keys.nz", "keys.bitmaps", "keys.offsets", "values.nz", "values.bitmaps", "values.offsets", "window.keys", "window.values")
    for name in need:
        if name not in enc.tensors:
            raise BadDataError(f"tensor {name!r} is missing")
    extra = sorted(set(enc.tensors) - set(need))
    if extra:
        raise BadDataError(f"unexpected tensor {extra[0]!r}")
    try:
        tc = int(enc.meta["compressed_tokens"])
        d = int(enc.meta["head_dim"])
        version = int(enc.meta.get("layout_version", LAYOUT_V1))
    except (KeyError, TypeError, ValueError):
        raise BadDataError("layer metadata lacks compressed_tokens / head_dim (or has a bad layout_version)") from None
    if version not in ORIENTATIONS:
        raise BadDataError(f"bitmap layout version {version} is not known to this kvtool (known: {sorted(ORIENTATIONS)})")
    korient, vorient = ORIENTATIONS[version]
    t = enc.tensors
    keys = BitmapTensor(korient, t["keys.nz"], t["keys.bitmaps"], t["keys.offsets"], tc, d, label="keys")
    values = BitmapTensor(vorient, t["values.nz"], t["values.bitmaps"], t["values.offsets"], tc, d, label="values")
    return BitmapCache(keys, values, t["window.keys"], t["window.values"], version=version)


def encoded_from_cache(cache: BitmapCache, meta: dict[str, Any]) -> Encoded:
    tensors = {}
    for kind, bt in (("keys", cache.keys), ("values", cache.values)):
        tensors[f"{kind}.nz"] = bt.nz
        tensors[f"{kind}.bitmaps"] = bt.bitmaps
        tensors[f"{kind}.offsets"] = bt.offsets
    tensors["window.keys"] = cache.window_keys
    tensors["window.values"] = cache.window_values
    return Encoded(tensors, meta)


def tensor_parts(bt: BitmapTensor) -> dict[str, int]:
    """Bytes of one compressed tensor by part: stored elements, bitmaps (bits for real positions),
    offsets, padding (alignment zeros in nz + bitmap bits of padding tokens/channels)."""
    item = bt.nz.element_size()
    stored = int(bt.block_counts().sum()) if bt.bitmaps.numel() else 0
    pad_bitmap_bytes = bt.pad_bits() // 8
    return {
        "nonzeros": stored * item,
        "bitmaps": bt.bitmaps.numel() * 8 - pad_bitmap_bytes,
        "offsets": bt.offsets.numel() * 8,
        "padding": (bt.nz.numel() - stored) * item + pad_bitmap_bytes,
    }


def paper_layout_bytes(bt: BitmapTensor) -> int:
    """Bytes the reference (Mustafar) layout would spend on the tiles as stored (layout version 2:
    token tiles of keys, channel tiles of values): per tile an 8-byte bitmap, a 4-byte offset and
    its non-zeros padded to 8 elements; plus one offset per row."""
    item = bt.nz.element_size()
    pc = popcount64(bt.bitmaps)
    tiles = pc.numel()
    return int(tiles * 12 + ((pc + 7) // 8 * 8).sum() * item + bt.batch * bt.kv_heads * 8)


def _fused_prune_encode(layer: LayerKV, params: BitmapParams, backend: str) -> bool:
    """Whether :meth:`BitmapFormat.encode` prunes and encodes in one CUDA launch: per-token pruning
    of keys and values, a tensor the kernel takes, and backend ``auto`` or ``cuda``."""
    if backend not in ENCODE_BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(ENCODE_BACKENDS)}, got {backend!r}")
    return backend in ("auto", "cuda") and parse_method(params.method) == ("per-token", "per-token") and can_run_cuda(layer.keys)


def _prune_encode_per_token(layer: LayerKV, params: BitmapParams) -> tuple[BitmapCache, dict[str, Any]]:
    """Per-token pruning + layout-v2 encoding of ``layer``'s compressed tokens on the GPU (the bytes
    of :func:`~kvtool.methods.prune.prune_layer` + :func:`encode_cache_v2`), and the prune stats."""
    t, d = layer.num_tokens, layer.keys.shape[-1]
    window = min(params.dense_window, t)
    tc = t - window
    parts = []
    achieved = []
    for x, orient, sparsity in zip((layer.keys, layer.values), ORIENTATIONS[LAYOUT_V2], (params.keys, params.values)):
        keep = keep_count(d, sparsity)
        parts.append(prune_encode(x[:, :, :tc], orient, keep, backend="cuda"))
        achieved.append(1.0 - keep / d if tc and sparsity > 0 else 0.0)
    parts[0].label, parts[1].label = "keys", "values"
    cache = BitmapCache(parts[0], parts[1], layer.keys[:, :, tc:].contiguous(), layer.values[:, :, tc:].contiguous(), version=LAYOUT_V2)
    return cache, {"method": "per-token", "achieved_key_sparsity": achieved[0], "achieved_value_sparsity": achieved[1]}


@register
class BitmapFormat(Format):
    name = "bitmap"
    summary = "Mustafar unstructured pruning + bitmap sparse tiles (sparsity 0.7, dense window 32)"
    Params = BitmapParams
    prunes_itself = True
    default_sweep = (
        'bitmap:sparsity=0.5,0.7,0.9',
    )
    paper_rows = (
        ('pruning method, keys+values at 50% (Mustafar Tab. 1/2/12)', 'per-token unstructured', 'bitmap:sparsity=0.5,method=per-token'),
        ('pruning method, keys+values at 50% (Mustafar Tab. 1/2/12)', 'per-channel unstructured', 'bitmap:sparsity=0.5,method=per-channel'),
        ('pruning method, keys+values at 50% (Mustafar Tab. 1/2/12)', 'ThinK-like structured channels', 'bitmap:sparsity=0.5,method=think'),
        ('pruning method, keys+values at 50% (Mustafar Tab. 1/2/12)', '2:4 semi-structured', 'bitmap:sparsity=0.5,method=2:4'),
        ('pruning method, keys+values at 70% (Mustafar Tab. 1/2)', 'per-token unstructured', 'bitmap:sparsity=0.7,method=per-token'),
        ('pruning method, keys+values at 70% (Mustafar Tab. 1/2)', 'per-channel unstructured', 'bitmap:sparsity=0.7,method=per-channel'),
        ('pruning method, keys+values at 70% (Mustafar Tab. 1/2)', 'output-aware', 'bitmap:sparsity=0.7,method=output-aware'),
        ('pruning method, keys+values at 70% (Mustafar Tab. 1/2)', 'ThinK-like structured channels', 'bitmap:sparsity=0.7,method=think'),
        ('what is pruned at 70% (Mustafar)', 'keys only', 'bitmap:key_sparsity=0.7,value_sparsity=0'),
        ('what is pruned at 70% (Mustafar)', 'values only', 'bitmap:key_sparsity=0,value_sparsity=0.7'),
        ('what is pruned at 70% (Mustafar)', 'keys and values', 'bitmap:sparsity=0.7'),
    )
    has_kernel = True
    live_grows = True

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> "BitmapLive":
        """The layer as a live cache layer (:class:`BitmapLive`): its whole 64-token blocks stay
        encoded; the tokens of a last partial block (decoded as pruned) join the dense window."""
        cache = cache_from_encoded(enc)
        if cache.version != LAYOUT_V2:
            cache = convert_layout(cache, LAYOUT_V2, backend="triton" if cache.window_keys.is_cuda else "torch")
        return BitmapLive.from_cache(self, cache, chunk_params(enc.meta), int(enc.meta.get("window", cache.window_keys.shape[2])), like)

    def live_from_dense(self, layer: LayerKV, params: FormatParams) -> "BitmapLive":
        """``encode`` of ``layer`` as a live layer (:meth:`live_layer`): every token before the
        dense window pruned as a file of the same tokens holds it (on the GPU: one launch per keys /
        values), so a press and a compressed file attend to the same numbers."""
        assert isinstance(params, BitmapParams)
        self.check(layer, params)
        return self.live_layer(self.encode(layer, params), layer.keys)

    def reads_queries(self, params: FormatParams) -> bool:
        """Only the output-aware pruning methods read queries."""
        return any(m in QUERY_METHODS for m in parse_method(params.method))

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        assert isinstance(params, BitmapParams)
        k, v = parse_method(params.method)
        if (k in QUERY_METHODS or v in QUERY_METHODS) and layer.queries is None:
            raise UsageError(f"method {params.method!r} needs the captured queries; this capture has none (recapture without --no-queries)")
        if layer.keys.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise BadDataError(f"bitmap stores float16, bfloat16 or float32 caches, got {layer.keys.dtype}")

    def encode(self, layer: LayerKV, params: FormatParams, backend: str = "auto") -> Encoded:
        """Prune ``layer`` (keys/values ``[B, Hkv, T, D]``) and store it. ``backend`` (identical
        bytes every way): ``torch``, ``triton`` (prune in torch, Triton encoder), ``cuda`` (per-token
        pruning and encoding in one launch, :func:`~kvtool.kernels.bitmap_prune_encode.prune_encode`;
        other methods fall back to ``triton``); ``auto``: cuda where it can run, else triton for CUDA
        tensors, else torch."""
        assert isinstance(params, BitmapParams)
        if _fused_prune_encode(layer, params, backend):
            cache, stats = _prune_encode_per_token(layer, params)
        else:
            if backend in ("auto", "cuda"):
                backend = "triton" if layer.keys.is_cuda else "torch"
            res = prune_layer(layer, params.keys, params.values, params.method, params.dense_window)
            cache = encode_cache_v2(res.keys, res.values, window=res.window, backend=backend)
            stats = res.stats
        meta = {
            "layout_version": LAYOUT_V2,
            "tokens": layer.num_tokens,
            "compressed_tokens": cache.keys.tokens,
            "window": cache.window_keys.shape[2],
            "head_dim": layer.keys.shape[-1],
            "dtype": dtype_name(layer.keys.dtype),
            "method": stats["method"],
            "key_sparsity": params.keys,
            "value_sparsity": params.values,
            "achieved_key_sparsity": stats["achieved_key_sparsity"],
            "achieved_value_sparsity": stats["achieved_value_sparsity"],
        }
        return encoded_from_cache(cache, meta)

    def decode(self, enc: Encoded) -> LayerKV:
        keys, values = cache_from_encoded(enc).decode()
        return LayerKV(keys=keys, values=values)

    def validate(self, enc: Encoded) -> None:
        cache = cache_from_encoded(enc)
        cache.validate()
        w = enc.meta.get("window")
        if w is not None and int(w) != cache.window_keys.shape[2]:
            raise BadDataError(f"the metadata says a window of {w} tokens, window.keys holds {cache.window_keys.shape[2]}")

    def nbytes(self, enc: Encoded) -> dict[str, int]:
        cache = cache_from_encoded(enc)
        parts = dict.fromkeys(PARTS, 0)
        for bt in (cache.keys, cache.values):
            for part, n in tensor_parts(bt).items():
                parts[part] += n
        parts["dense_window"] = sum(t.numel() * t.element_size() for t in (cache.window_keys, cache.window_values))
        return parts

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = cache_from_encoded(enc).decode()
        return attend_partial(q, keys, values, scale)

    def attend_kernel(self, q: torch.Tensor, enc: Encoded, scale: float | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~kvtool.kernels.bitmap_sparse_attention.bitmap_sparse_attention` (``backend``
        auto / triton / cuda); a version-1 layer is converted to layout version 2 first. The
        layer's kernel view is held on ``enc`` while its tensors stay the same objects, so that a
        decode loop validates and plans it once (the plan: kernels.bitmap_sparse_attention)."""
        held = enc.__dict__.get("_kernel_view")
        tensors = tuple(enc.tensors.values())
        if held is None or len(held[0]) != len(tensors) or not all(a is b for a, b in zip(held[0], tensors)):
            cache = cache_from_encoded(enc)
            if cache.version != LAYOUT_V2:
                cache.validate()
                cache = convert_layout(cache, LAYOUT_V2, backend="triton" if q.is_cuda else "torch")
            held = (tensors, cache)
            enc.__dict__["_kernel_view"] = held
        return bitmap_sparse_attention(q, held[1], scale, backend=backend)

    def report(self, cc: CompressedCache, source: KVCache | None = None) -> dict[str, Any]:
        """Achieved sparsity (of the pruned tokens, by the masks, and as stored), bytes by part for
        keys and values apart, and the bytes the paper's layout would need for the same tiles."""
        out: dict[str, Any] = {}
        n = {"keys": 0, "values": 0}
        stored = {"keys": 0, "values": 0}
        elems = 0
        achieved = {"keys": 0.0, "values": 0.0}
        paper = 0
        by_kind: dict[str, dict[str, int]] = {"keys": {}, "values": {}}
        for enc in cc.layers.values():
            cache = cache_from_encoded(enc)
            e = cache.keys.batch * cache.keys.kv_heads * cache.keys.tokens * cache.keys.head_dim
            elems += e
            for kind, bt in (("keys", cache.keys), ("values", cache.values)):
                achieved[kind] += float(enc.meta.get(f"achieved_{kind[:-1]}_sparsity", 0.0)) * e
                stored[kind] += int(bt.block_counts().sum()) if bt.bitmaps.numel() else 0
                paper += paper_layout_bytes(bt)
                for part, v in tensor_parts(bt).items():
                    by_kind[kind][part] = by_kind[kind].get(part, 0) + v
                n[kind] += e
            win = cache.window_keys
            paper += 2 * win.numel() * win.element_size()
        rep = cc.byte_report()
        if elems:
            out["achieved_key_sparsity"] = achieved["keys"] / elems
            out["achieved_value_sparsity"] = achieved["values"] / elems
            out["stored_key_density"] = stored["keys"] / n["keys"]
            out["stored_value_density"] = stored["values"] / n["values"]
        out["method"] = next(iter(cc.layers.values())).meta.get("method") if cc.layers else None
        out["layout_version"] = int(next(iter(cc.layers.values())).meta.get("layout_version", LAYOUT_V1)) if cc.layers else None
        out["dense_window_tokens"] = next(iter(cc.layers.values())).meta.get("window") if cc.layers else None
        out["paper_layout_bytes"] = paper
        out["paper_layout_rate_percent"] = 100.0 * paper / rep["dense_bytes"] if rep["dense_bytes"] else None
        out["bytes_by_part_keys"] = by_kind["keys"]
        out["bytes_by_part_values"] = by_kind["values"]
        return out



# ----------------------------------------------------------------------------- live cache


def chunk_params(meta: dict[str, Any]) -> BitmapParams:
    """How a live layer prunes each filled block: per token (the fused prune + encode on the GPU) at
    the layer's key / value sparsity, no window."""
    ks, vs = float(meta.get("key_sparsity", 0.7)), float(meta.get("value_sparsity", 0.7))
    return BitmapParams(sparsity=ks, key_sparsity=ks, value_sparsity=vs, method="per-token", dense_window=0)


def largest_run(bt: BitmapTensor) -> int:
    """The most elements one block of ``bt`` stores, padded as stored (one host sync)."""
    if not bt.blocks or bt.batch * bt.kv_heads == 0:
        return 0
    return int((bt.offsets[1:] - bt.offsets[:-1]).max())


class BitmapLive(LiveLayer):
    """A live ``bitmap`` layer on the kernel's cache with room to grow
    (:func:`~kvtool.kernels.bitmap_layout.growable_cache`): each 64-token block's keys and values in a
    fixed slot of ``nz`` (``64 * keep`` elements for per-token pruning), capacity for 1/32 more
    tokens (at least two blocks), and a dense window of ``window + 64`` slots; the tokens in use are
    ``lengths`` on the device. A new token is written into the window at ``lengths[1]`` on the
    device; when the window holds ``window + 64`` tokens its oldest 64 are pruned and encoded
    (``BitmapFormat.encode``: on the GPU the fused prune + encode) and written into the next block's
    slots (:func:`~kvtool.kernels.bitmap_layout.append_blocks`, device work), the rest of the window
    moves down. A step attends through :func:`bitmap_sparse_attention` (planned once for the cache:
    no host syncs, capturable in a CUDA graph that stays valid while blocks join), or the torch
    decode of the blocks in use on the CPU. A full capacity is re-laid once into a larger one."""

    def __init__(self, fmt: "BitmapFormat", keys: BitmapTensor, values: BitmapTensor, params: BitmapParams, window: int,
                 tail_keys: torch.Tensor, tail_values: torch.Tensor) -> None:
        self.fmt, self.params, self.window = fmt, params, int(window)
        self.chunk = TILE
        self.wcap = self.window + TILE
        # window slots allocated: the window's whole span (dense_window + 64) unless that is more than
        # LIVE_HEADROOM beyond the tokens there are (dense_window=2^24), then those tokens + the headroom
        self.wslots = min(self.wcap, tail_keys.shape[2] + LIVE_HEADROOM)
        d = keys.head_dim
        per_token = TILE * max(keep_count(d, params.keys), keep_count(d, params.values))
        align = 16 // tail_keys.element_size()
        self.slot = -(-max(per_token, largest_run(keys), largest_run(values)) // align) * align
        self.cache_dtype = tail_keys.dtype
        self._make(keys, values, keys.blocks + max(2, keys.blocks // 32))
        self.wn = 0
        self.append(tail_keys, tail_values)

    @classmethod
    def from_cache(cls, fmt: "BitmapFormat", cache: BitmapCache, params: BitmapParams, window: int, like: torch.Tensor) -> "BitmapLive":
        """From a packed layout-v2 cache; the tokens of a last partial block (decoded, pruned) join
        the dense window."""
        tc = cache.keys.tokens
        aligned = tc // TILE * TILE
        keys, values = cache.keys, cache.values
        tail_k, tail_v = cache.window_keys, cache.window_values
        if aligned != tc:
            kd, vd = keys.decode(), values.decode()
            backend = "triton" if kd.is_cuda and not interpreting() else "torch"
            head = encode_cache_v2(kd[:, :, :aligned].contiguous(), vd[:, :, :aligned].contiguous(), window=0, backend=backend)
            keys, values = head.keys, head.values
            tail_k = torch.cat([kd[:, :, aligned:], tail_k], dim=2)
            tail_v = torch.cat([vd[:, :, aligned:], tail_v], dim=2)
        return cls(fmt, keys, values, params, window, tail_k.to(like.device), tail_v.to(like.device))

    def _make(self, keys: BitmapTensor, values: BitmapTensor, capacity_blocks: int) -> None:
        """A cache with room for ``capacity_blocks`` blocks holding the packed ``keys`` / ``values``
        (whole blocks) and an empty window."""
        self.cache = growable_cache(keys.batch, keys.kv_heads, keys.head_dim, capacity_blocks * TILE, self.wslots, self.slot, self.cache_dtype,
                                    keys.bitmaps.device)
        append_blocks(self.cache, keys, values)
        self.nblocks = keys.blocks

    @property
    def capacity_blocks(self) -> int:
        return self.cache.keys.blocks

    @property
    def tokens(self) -> int:
        return self.nblocks * TILE + self.wn

    def reference_tensor(self) -> torch.Tensor:
        return self.cache.window_keys

    def encoded_shape(self) -> tuple[int, int, int, int]:
        k = self.cache.keys
        return k.batch, k.kv_heads, self.tokens, k.head_dim

    def _sync(self) -> None:
        """The host's window count from the device's length (replayed steps append on the device
        only); eager work: one host read."""
        if not (self.cache.lengths.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.wn = int(self.cache.lengths[1])

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        done, n = 0, keys.shape[2]
        self._sync()
        while done < n:
            take = min(n - done, self.wcap - self.wn)
            if self.wn + take > self.wslots:  # eager: the window's buffers follow its tokens
                self._grow_window(self.wn + take)
            # read each time round: a grown window or an absorb that re-lays the cache replaces them
            wk, wv, ln = self.cache.window_keys, self.cache.window_values, self.cache.lengths
            # written where the device says the window ends, so a captured step keeps appending
            idx = ln[1:2].long() + torch.arange(take, device=wk.device)
            wk.index_copy_(2, idx, keys[:, :, done:done + take].to(wk.dtype))
            wv.index_copy_(2, idx, values[:, :, done:done + take].to(wv.dtype))
            ln[1:2] += take
            self.wn += take
            done += take
            if self.wn == self.wcap:
                self.absorb()

    def absorb(self) -> None:
        """The window's oldest 64 tokens pruned, encoded and appended as a block (eager: the encode
        reads one flag on the host)."""
        wk, wv, ln = self.cache.window_keys, self.cache.window_values, self.cache.lengths
        enc = self.fmt.encode(LayerKV(wk[:, :, :TILE].contiguous(), wv[:, :, :TILE].contiguous()), self.params)
        block = cache_from_encoded(enc)
        run = max(largest_run(block.keys), largest_run(block.values))
        if run > self.slot or self.nblocks + 1 > self.capacity_blocks:
            self._relay(max(self.slot, run), self.nblocks + 1 + max(2, self.nblocks // 32))
            wk, wv, ln = self.cache.window_keys, self.cache.window_values, self.cache.lengths  # the new cache's window
        append_blocks(self.cache, block.keys, block.values)
        self.nblocks += 1
        rest = self.wn - TILE
        wk[:, :, :rest] = wk[:, :, TILE:self.wn].clone()
        wv[:, :, :rest] = wv[:, :, TILE:self.wn].clone()
        ln[1:2] -= TILE
        self.wn = rest

    def _relay(self, slot: int, capacity_blocks: int) -> None:
        """Move the blocks in use into a cache of larger slots or capacity (once per growth)."""
        wk, wv = self.cache.window_keys[:, :, :self.wn].clone(), self.cache.window_values[:, :, :self.wn].clone()
        used = self.cache.in_use()
        kd, vd = used.keys.decode(), used.values.decode()
        backend = "triton" if kd.is_cuda and not interpreting() else "torch"
        packed = encode_cache_v2(kd, vd, window=0, backend=backend)
        align = 16 // wk.element_size()
        self.slot = -(-slot // align) * align
        self._make(packed.keys, packed.values, capacity_blocks)
        self.cache.window_keys[:, :, :self.wn] = wk
        self.cache.window_values[:, :, :self.wn] = wv
        self.cache.lengths[1:2] += self.wn

    def _grow_window(self, need: int) -> None:
        """Window buffers of at least ``need`` slots, doubling up to the window's span (eager work:
        a re-allocation invalidates CUDA graphs captured before)."""
        slots = min(self.wcap, max(need, 2 * self.wslots))
        for name in ("window_keys", "window_values"):
            old = getattr(self.cache, name)
            new = old.new_zeros((*old.shape[:2], slots, old.shape[3]))
            new[:, :, :self.wn] = old[:, :, :self.wn]
            setattr(self.cache, name, new)
        self.wslots = slots

    def room(self) -> int:
        return min(self.wcap, self.wslots) - self.wn - 1

    def reserve(self, steps: int) -> None:
        """Encode a block now if fewer than ``steps`` single-token steps fit before the next one
        (and grow the window's buffers towards its span when that is what is short)."""
        self._sync()
        if self.room() < steps and self.wslots < self.wcap:
            self._grow_window(min(self.wcap, self.wn + steps + 1))
        while self.room() < steps and self.wn >= TILE:
            self.absorb()

    def prepare(self, query_tokens: int = 1) -> None:
        if on_gpu(self.cache.window_keys):
            prepare_attention(self.cache)

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        if on_gpu(q):
            return bitmap_sparse_attention(q, self.cache, scale)
        keys, values = self.cache.in_use().decode()
        return attend_partial(q, keys, values, scale)

    def stored_bytes(self) -> int:
        c = self.cache
        return sum(t.numel() * t.element_size() for t in (c.keys.nz, c.keys.bitmaps, c.keys.offsets, c.values.nz, c.values.bitmaps,
                                                          c.values.offsets, c.window_keys, c.window_values, c.lengths))

    def workspace_bytes(self, query_rows: int) -> int:
        """A step: the kernel's split partials (float32 ``[B * Hkv, splits + 1, rows, D]`` plus their
        maxima and sums, at most one split per pair of blocks of the capacity, rows padded to 16)."""
        b, h, _, d = self.encoded_shape()
        splits = -(-self.capacity_blocks // 2) + 1
        rows = max(16, query_rows // max(1, b * h))
        return 4 * b * h * (splits + 1) * rows * (max(64, d) + 2)

    def join_bytes(self) -> int:
        """A block's encode (its dense tokens and their encoding); a re-laid capacity: the layer
        decoded once (rare)."""
        b, h, _, d = self.encoded_shape()
        return 4 * b * h * TILE * d * self.cache.window_keys.element_size()

    def encoded(self) -> Encoded:
        """The blocks in use and the window as a packed layout-v2 layer (the bytes ``encode`` writes)."""
        used = self.cache.in_use()
        kd, vd = used.keys.decode(), used.values.decode()
        packed = encode_cache_v2(kd, vd, window=0, backend="torch" if not kd.is_cuda or interpreting() else "triton")
        wk = self.cache.window_keys[:, :, :self.wn].contiguous()
        wv = self.cache.window_values[:, :, :self.wn].contiguous()
        meta = {"layout_version": LAYOUT_V2, "tokens": self.tokens, "compressed_tokens": packed.keys.tokens, "window": self.wn,
                "head_dim": packed.keys.head_dim, "dtype": dtype_name(wk.dtype), "method": self.params.method,
                "key_sparsity": self.params.keys, "value_sparsity": self.params.values,
                "achieved_key_sparsity": self.params.keys, "achieved_value_sparsity": self.params.values}
        return encoded_from_cache(BitmapCache(packed.keys, packed.values, wk, wv, LAYOUT_V2), meta)
