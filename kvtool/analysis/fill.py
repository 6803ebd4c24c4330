"""Uniform settings that fill a byte budget: one per format family, its parameter searched.

A fair baseline for a plan at ``f`` of the float16 bytes is each family's own best use of the same
bytes, not a point of a fixed menu that happens to fit (a menu that evicts to 1/8, 1/4 or 1/2 of the
tokens leaves most of a 15% budget unused). :func:`fill_spec` searches the family's parameter so
that the stored bytes come as close to ``f`` as the family allows without exceeding it:

The families are :data:`kvtool.analysis.menu.FAMILIES` (each eviction x each storage, and the
storages and per-element families alone):

| family | what is searched |
|---|---|
| ``kivi`` | KIVI with the partial key group quantised and no residual: the most bits (8, 4, 2) and then the smallest group (32, 64, 128) that fit; then the full-precision residual (recent tokens) grown to fill the rest |
| ``rkivi`` | the same search with each key and value head vector rotated first (``rotate=hadamard``: a Walsh-Hadamard rotation, :mod:`kvtool.methods.rotation`) |
| ``snapkv`` / ``streaming`` | the kept share of the tokens (``snapstream:share=``), SnapKV + sinks + recent, or sinks + recent only (StreamingLLM), stored in float16 |
| ``EVICTION+STORAGE`` (``snapkv+kivi4``, ``streaming+kivi2g128``, ...) | the kept share of that eviction, its tokens stored in that storage (KIVI 4 / 2 bits, groups of 32 or 128, partial group quantised, no residual): the eviction keeps about budget / storage ratio of the tokens |
| a storage marked ``alone`` (:class:`kvtool.analysis.menu.Storage`) | every token in that storage, the full-precision residual grown to fill the rest |
| ``bitmap`` | the sparsity of per-token magnitude pruning (Mustafar) |
| ``bitmapq`` | the sparsity of pruning with 4-bit codes for the kept elements |
| ``signvq`` | the most bits (4, 2) that fit (sign-VQ has no finer knob) |

Bytes are counted by encoding one synthetic layer of the same shape (every format here stores a
count of bytes fixed by the shape and parameters) against float16 keys and values:
``2 x KV heads x tokens x head_dim x 2 bytes``. Families that cannot reach ``f`` give None (KIVI
below about 15%, sign-VQ below about 20%).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.core.names import closest
from kvtool.formats.base import get_format
from kvtool.formats.mixed import resolve_spec
from kvtool.formats.pipeline import encode_kept
from kvtool.analysis.menu import EVICTIONS, FAMILIES, KIVI_SEARCH, STORAGES, split_family

KIVI_CHOICES = [(bits, group) for bits in (8, 4, 2) for group in (32, 64, 128)]


@functools.lru_cache(maxsize=64)
def _layer(tokens: int, kv_heads: int, heads: int, head_dim: int) -> LayerKV:
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randn(1, kv_heads, tokens, head_dim, generator=gen).half()
    v = torch.randn(1, kv_heads, tokens, head_dim, generator=gen).half()
    q = torch.randn(1, heads, tokens, head_dim, generator=gen).half()
    return LayerKV(keys=k, values=v, queries=q)


def spec_ratio(spec: str, tokens: int, kv_heads: int, heads: int, head_dim: int) -> float:
    """Stored bytes of ``spec`` on one layer of ``tokens`` tokens over float16 keys and values."""
    layer = _layer(tokens, kv_heads, heads, head_dim)
    fmt, params = resolve_spec(spec)
    fmt.check(layer, params)
    enc = fmt.encode(layer, params)
    return sum(fmt.nbytes(enc).values()) / (2 * kv_heads * tokens * head_dim * 2)


def _largest(make: Callable[[int], str], lo: int, hi: int, fraction: float, ratio: Callable[[str], float]) -> str | None:
    """The spec ``make(n)`` with the largest integer n in [lo, hi] whose ratio is at most
    ``fraction`` (ratio non-decreasing in n), or None when even ``make(lo)`` exceeds it."""
    if ratio(make(lo)) > fraction:
        return None
    if ratio(make(hi)) <= fraction:
        return make(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ratio(make(mid)) <= fraction:
            lo = mid
        else:
            hi = mid
    return make(lo)


def _num(x: float) -> str:
    return f"{x:.6f}".rstrip("0").rstrip(".")


@functools.lru_cache(maxsize=512)
def fill_spec(family: str, fraction: float, tokens: int, kv_heads: int, heads: int, head_dim: int) -> str | None:
    """The ``family``'s spec that fills ``fraction`` of the float16 bytes of a ``tokens``-token
    prefix (see the module docstring), or None when the family cannot get that small. The search
    runs over whole tokens (eviction shares, residual) or whole kept elements per token (sparsity)."""
    group = max(1, heads // kv_heads)

    def ratio(spec: str) -> float:
        # one KV head: every family stores the same bytes per KV head
        return spec_ratio(spec, tokens, 1, group, head_dim)

    floor = 37  # sinks + recent + one chosen token
    if family in KIVI_SEARCH:
        extra = KIVI_SEARCH[family]
        for bits, g in KIVI_CHOICES:
            base = f"quant:bits={bits},group={g},residual=0,partial=true{extra}"
            if ratio(base) <= fraction:
                return _largest(lambda r: f"quant:bits={bits},group={g},residual={r},partial=true{extra}", 0, tokens, fraction, ratio)
        return None
    evict, store = split_family(family)
    if evict is not None:
        alone_spec, step = EVICTIONS[evict]
        storage = STORAGES[store].spec
        make = (lambda n: alone_spec.format(share=_num(n / tokens))) if storage is None else \
            (lambda n: step.format(share=_num(n / tokens)) + "+" + storage)
        return _largest(make, min(floor, tokens), tokens, fraction, ratio)
    if store in STORAGES:  # a storage alone: its full-precision residual grown to fill the rest
        spec = STORAGES[store].spec or "dense"
        return _largest(lambda r: spec.replace("residual=0", f"residual={r}"), 0, tokens, fraction, ratio)
    if family == "bitmap":
        return _largest(lambda n: f"bitmap:sparsity={_num(1 - n / head_dim)}", 1, head_dim, fraction, ratio)
    if family == "bitmapq":
        return _largest(lambda n: f"bitmapq:sparsity={_num(1 - n / head_dim)},bits=4", 1, head_dim, fraction, ratio)
    if family == "signvq":
        for bits in (4, 2):
            spec = f"signvq:bits={bits}"
            if ratio(spec) <= fraction:
                return spec
        return None
    raise UsageError(f"unknown family {family!r}{closest(family, FAMILIES)}; families: {', '.join(FAMILIES)}")


def press_keep(fraction: float, tokens: int, head_dim: int, storage: str = "dense", kv_heads: int = 1, heads: int = 1) -> float | None:
    """The kept share of a press whose tokens are stored with ``storage`` that fills ``fraction``
    of the float16 bytes (kept positions counted), as kvpress's ``int(T * keep)`` kept tokens; None
    when not even one token fits."""
    layer = _layer(tokens, kv_heads, heads, head_dim)
    dense = 2 * kv_heads * tokens * head_dim * 2
    pipeline = get_format("pipeline")

    def r(n: int) -> float:
        kept = torch.arange(n).expand(1, kv_heads, n)
        return sum(pipeline.nbytes(encode_kept(LayerKV(layer.keys, layer.values), kept, storage)).values()) / dense

    lo, hi = 1, tokens
    if r(lo) > fraction:
        return None
    if r(hi) <= fraction:
        return 1.0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if r(mid) <= fraction:
            lo = mid
        else:
            hi = mid
    return (lo + 0.5) / tokens
