"""Decode attention over a bitmap-compressed cache plus its dense window (Triton), and the torch
reference of the same maths.

Entry point: :func:`bitmap_decode_attention` ``(q, cache, scale=None, num_splits=None,
validate=True) -> (out, lse)``

- ``q``: ``[B, H, Tq, D]`` float16 / bfloat16 (float32 works too), the cache's dtype and device; H a
  multiple of the cache's Hkv (query head h reads KV head ``h // G``). Decode is Tq = 1; Tq > 1 scores
  several queries against the same cache (no causal mask: every cached token precedes them).
- ``cache``: :class:`~.bitmap_layout.BitmapCache` (make one with
  :func:`~.bitmap_compress.encode_cache`).
- returns the partial of :mod:`kvtool.attention`: ``out`` ``[B, H, Tq, D]`` float32 (softmax-weighted
  values), ``lse`` ``[B, H, Tq]`` float32 (natural log-sum-exp of the scaled scores).

How it runs: grid ``(B * Hkv, S + 1)``. Program (bh, s < S) walks token blocks ``s * BPS ..`` of KV
head bh, BPS = ceil(NB / S), 32 tokens at a time (one 32-bit half of every key bitmap). An element's
place in its block's packed run is ``run start + popcount(word & bits below it)``: run starts come
from a 1-D prefix sum of per-tile popcounts (per channel for keys, per token for values), the rest is
one ``popc.b32`` per element on CUDA (SWAR arithmetic under the interpreter); there are no 2-D prefix
sums. It gathers K^T ``[D, 32]`` and scores all G * Tq query rows of the group at once (one pass over
the group's data), runs an online softmax (base 2, float32), gathers V ``[32, D]`` the same way and
accumulates P.V in float32. Program (bh, S) does the same over the dense window. A second kernel
merges the S + 1 partials (flash-decoding combine). Every load is masked; the offsets are validated
before launch (``validate=True``) so no gather leaves ``nz``. Built for sm_90 without register spills
at D = 64 and 128 (the tests compile it with the bundled ptxas).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..attention import attend_partial, default_scale
from ..errors import UsageError
from .bitmap_compress import _check_device
from .bitmap_layout import TILE, BitmapCache
from .online_softmax import attend_block as _attend_block

LOG2E = 1.4426950408889634


@triton.jit
def _popc32(x, USE_ASM: tl.constexpr):
    """Set bits of each int32: one ``popc.b32`` on CUDA, SWAR on the unsigned view otherwise."""
    if USE_ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        u = x.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _bitmap_attention_kernel(
    q_ptr,  # [B*Hkv, R, D]: the R = G*Tq query rows of each KV head, contiguous
    kbm_ptr,  # int32 view of keys.bitmaps [B*Hkv, NB, D, 2]
    knz_ptr,  # keys.nz
    koff_ptr,  # keys.offsets int64 [B*Hkv*NB + 1]
    vbm_ptr,  # int32 view of values.bitmaps [B*Hkv, Tc, DT, 2]
    vnz_ptr,  # values.nz
    voff_ptr,  # values.offsets
    wk_ptr,  # window keys [B*Hkv, W, D]
    wv_ptr,  # window values [B*Hkv, W, D]
    acc_ptr,  # float32 [B*Hkv, S+1, RP, DP]
    m_ptr,  # float32 [B*Hkv, S+1, RP]
    l_ptr,  # float32 [B*Hkv, S+1, RP]
    scale_log2,
    Tc,
    W,
    D,
    DT,
    NB,
    R,
    BPS,
    S,
    RP: tl.constexpr,
    DP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.arange(0, RP)
    c = tl.arange(0, DP)
    cmask = c < D
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + c[None, :], mask=(rows[:, None] < R) & cmask[None, :], other=0.0)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DP], tl.float32)
    h32 = tl.arange(0, 32)
    if split < S:
        blk_start = split * BPS
        blk_end = tl.minimum(blk_start + BPS, NB)
        j = tl.arange(0, DP // 64)
        i64 = tl.arange(0, 64)
        kbelow = ((tl.full([32], 1, tl.int32) << h32) - 1)[None, :]  # the bits under each position
        vshift = (i64 % 32)[None, None, :]
        vbelow = (tl.full([64], 1, tl.int32) << (i64 % 32)) - 1
        vlow = (i64 < 32)[None, None, :]
        for blk in range(blk_start, blk_end):
            g = bh * NB + blk
            kstart = tl.load(koff_ptr + g)
            vstart = tl.load(voff_ptr + g)
            # key tile c = channel c of the block's 64 tokens: low word = tokens 0-31, high = 32-63
            klo = tl.load(kbm_ptr + (g * D + c) * 2, mask=cmask, other=0)
            khi = tl.load(kbm_ptr + (g * D + c) * 2 + 1, mask=cmask, other=0)
            plo = _popc32(klo, USE_ASM)
            kcnt = plo + _popc32(khi, USE_ASM)
            ktile = tl.cumsum(kcnt, axis=0) - kcnt  # start of each channel's run in the block
            vbase = tl.zeros([], tl.int32)  # value elements of the block before the current half
            for half in range(0, 2):
                # keys: element (c, token) sits at run start + set bits below it in its word
                kw = tl.where(half == 0, klo, khi)[:, None]  # [DP, 1]
                kset = ((kw >> h32[None, :]) & 1) != 0  # [DP, 32]
                kpos = (ktile + plo * half)[:, None] + _popc32(kw & kbelow, USE_ASM)
                kt = tl.load(knz_ptr + kstart + kpos, mask=kset, other=0.0)  # K^T [DP, 32]
                tok = blk * 64 + half * 32 + h32
                tmask = tok < Tc
                # values: tile (token, j) words [32, DP/64] as low/high halves
                wptr = vbm_ptr + ((bh * Tc + tok[:, None]) * DT + j[None, :]) * 2
                wmask = tmask[:, None] & (j[None, :] < DT)
                vlo = tl.load(wptr, mask=wmask, other=0)
                vhi = tl.load(wptr + 1, mask=wmask, other=0)
                plo_v = _popc32(vlo, USE_ASM)
                ptile = plo_v + _popc32(vhi, USE_ASM)
                tile_pre = tl.cumsum(ptile, axis=1) - ptile  # elements of the token before tile j
                vrow = tl.sum(ptile, axis=1)
                vfirst = vbase + tl.cumsum(vrow, axis=0) - vrow  # [32] each token's run start
                vw = tl.where(vlow, vlo[:, :, None], vhi[:, :, None])  # [32, DP/64, 64]
                vpre = vfirst[:, None, None] + tile_pre[:, :, None] + tl.where(vlow, 0, plo_v[:, :, None])
                vbit = tl.reshape((vw >> vshift) & 1, (32, DP))
                vpos = tl.reshape(vpre + _popc32(vw & vbelow[None, None, :], USE_ASM), (32, DP))
                v = tl.load(vnz_ptr + vstart + vpos, mask=vbit != 0, other=0.0)  # [32, DP]
                vbase = vbase + tl.sum(vrow, axis=0)
                m_i, l_i, acc = _attend_block(q, kt, v, tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    else:
        for w0 in range(0, W, 32):
            tw = w0 + h32
            wmask = tw < W
            kt = tl.load(wk_ptr + (bh * W + tw[None, :]) * D + c[:, None], mask=wmask[None, :] & cmask[:, None], other=0.0)
            v = tl.load(wv_ptr + (bh * W + tw[:, None]) * D + c[None, :], mask=wmask[:, None] & cmask[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, kt, v, wmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    slot = bh * (S + 1) + split
    tl.store(acc_ptr + (slot * RP + rows[:, None]) * DP + c[None, :], acc, mask=rows[:, None] < R)
    tl.store(m_ptr + slot * RP + rows, m_i)
    tl.store(l_ptr + slot * RP + rows, l_i)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, R, D, S, RP: tl.constexpr, DP: tl.constexpr):
    """Merge the S + 1 partials of one KV head's query rows: out [B*Hkv, R, D], lse [B*Hkv, R]."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, RP)
    c = tl.arange(0, DP)
    m_max = tl.full([RP], float("-inf"), tl.float32)
    for s in range(0, S + 1):
        m_max = tl.maximum(m_max, tl.load(m_ptr + (bh * (S + 1) + s) * RP + rows))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([RP], tl.float32)
    out = tl.zeros([RP, DP], tl.float32)
    for s in range(0, S + 1):
        slot = bh * (S + 1) + s
        w = tl.exp2(tl.load(m_ptr + slot * RP + rows) - m_safe)
        total += tl.load(l_ptr + slot * RP + rows) * w
        out += tl.load(acc_ptr + (slot * RP + rows[:, None]) * DP + c[None, :], mask=rows[:, None] < R, other=0.0) * w[:, None]
    nonempty = total > 0
    out = out / tl.where(nonempty, total, 1.0)[:, None]
    lse = tl.where(nonempty, (m_safe + tl.log2(tl.where(nonempty, total, 1.0))) * 0.6931471805599453, float("-inf"))
    rmask = rows < R
    tl.store(out_ptr + (bh * R + rows[:, None]) * D + c[None, :], out, mask=rmask[:, None] & (c[None, :] < D))
    tl.store(lse_ptr + bh * R + rows, lse, mask=rmask)


def check_query(q: torch.Tensor, cache: BitmapCache) -> None:
    """Shapes, dtype and device of ``q`` against the cache; UsageError naming what disagrees."""
    k = cache.keys
    if q.ndim != 4:
        raise UsageError(f"q must be [batch, heads, query_tokens, head_dim], got shape {list(q.shape)}")
    b, h, _, d = q.shape
    if b != k.batch or d != k.head_dim or h % k.kv_heads:
        raise UsageError(
            f"q has shape {list(q.shape)}; expected [{k.batch}, a multiple of {k.kv_heads} heads, query_tokens, {k.head_dim}] for this cache"
        )
    if q.dtype != k.dtype:
        raise UsageError(f"q is {q.dtype} but the cache is {k.dtype}")
    for name, t in (("keys.nz", k.nz), ("keys.bitmaps", k.bitmaps), ("values.nz", cache.values.nz), ("window.keys", cache.window_keys)):
        if t.device != q.device:
            raise UsageError(f"{name} is on {t.device} but q is on {q.device}")


def default_splits(bh: int, blocks: int, device: torch.device) -> int:
    """Token-axis splits per KV head: about 16 programs per SM in all (several waves, so the last
    partial wave costs little; the H100 profile at 4 per SM showed 1.2 waves), at least 2 blocks per
    program; 1 on the CPU interpreter."""
    if blocks == 0 or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, math.ceil(16 * sms / max(bh, 1)))
    return max(1, min(-(-blocks // 2), want))


def bitmap_decode_attention(
    q: torch.Tensor,
    cache: BitmapCache,
    scale: float | None = None,
    num_splits: int | None = None,
    validate: bool = True,
    num_warps: int = 4,
    num_stages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, Tq, D]`` over the compressed tokens and the dense window of
    ``cache``: the partial (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32). See the module
    docstring. ``validate=False`` skips the layout check (only for a cache validated before: the
    kernel trusts the offsets). ``num_splits`` (token-axis programs per KV head), ``num_warps`` and
    ``num_stages`` are tuning knobs; the result does not depend on them beyond rounding. One stage
    (no software pipelining of the block loop) was faster for the bench's popcount variant of this
    kernel on the H100 in every configuration it timed."""
    check_query(q, cache)
    _check_device(q, "q")
    if validate:
        cache.validate()
    k, v = cache.keys, cache.values
    b, h, tq, d = q.shape
    hkv = k.kv_heads
    rows = (h // hkv) * tq
    bh = b * hkv
    nb = k.blocks
    w = cache.window_keys.shape[2]
    out = torch.empty(b, h, tq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, tq, dtype=torch.float32, device=q.device)
    if bh == 0 or rows == 0:
        return out, lse
    splits = default_splits(bh, nb, q.device) if num_splits is None else int(num_splits)
    if splits < 1:
        raise UsageError(f"num_splits must be at least 1, got {num_splits}")
    bps = max(1, -(-nb // splits))
    splits = max(1, -(-nb // bps)) if nb else 1
    rp = max(16, triton.next_power_of_2(rows))
    dp = max(64, triton.next_power_of_2(d))
    acc = torch.empty(bh, splits + 1, rp, dp, dtype=torch.float32, device=q.device)
    m = torch.empty(bh, splits + 1, rp, dtype=torch.float32, device=q.device)
    l = torch.empty(bh, splits + 1, rp, dtype=torch.float32, device=q.device)
    scale = default_scale(d) if scale is None else scale
    qc = q.contiguous()
    # the interpreter gets bfloat16 tl.dot wrong: there, bfloat16 products run in float32
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    empty = torch.zeros(1, dtype=q.dtype, device=q.device)
    _bitmap_attention_kernel[(bh, splits + 1)](
        qc,
        k.bitmaps.view(torch.int32),
        k.nz if k.nz.numel() else empty,
        k.offsets,
        v.bitmaps.view(torch.int32),
        v.nz if v.nz.numel() else empty,
        v.offsets,
        cache.window_keys.contiguous() if w else empty,
        cache.window_values.contiguous() if w else empty,
        acc,
        m,
        l,
        float(scale) * LOG2E,
        k.tokens,
        w,
        d,
        -(-d // TILE),
        nb,
        rows,
        bps,
        splits,
        RP=rp,
        DP=dp,
        DOT_PREC=prec,
        UPCAST=upcast,
        USE_ASM=q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _combine_kernel[(bh,)](acc, m, l, out, lse, rows, d, splits, RP=rp, DP=dp, num_warps=4)
    return out, lse


def kernel_bytes(cache: BitmapCache, q: torch.Tensor | None = None) -> int:
    """Bytes one call of :func:`bitmap_decode_attention` must read from memory: every tensor of the
    cache (packed elements, bitmaps, offsets, window) plus ``q`` when given (outputs not counted)."""
    parts = [cache.keys.nz, cache.keys.bitmaps, cache.keys.offsets, cache.values.nz, cache.values.bitmaps, cache.values.offsets, cache.window_keys, cache.window_values]
    if q is not None:
        parts.append(q)
    return sum(t.numel() * t.element_size() for t in parts)


def bitmap_attention_reference(q: torch.Tensor, cache: BitmapCache, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: decode the layout and run :func:`kvtool.attention.attend_partial`."""
    keys, values = cache.decode()
    return attend_partial(q, keys, values, scale)
