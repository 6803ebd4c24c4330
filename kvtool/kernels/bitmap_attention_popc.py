"""Bitmap decode attention with popcount ranks (a variant of :mod:`.bitmap_attention`, same maths,
same layout, same entry-point signature), written from the bench's H100 profile.

Profile of :func:`.bitmap_attention.bitmap_decode_attention` (H100, Llama-3-8B shapes, batch 8,
32k tokens, 70% sparsity): 254 registers per thread, 12.5% occupancy, 72 KB of shared memory per
program for the two 2-D prefix sums over each block's bitmap bits, DRAM at 4% of peak: the kernel
is bound by the per-element scan work, not by memory.

This variant drops the 2-D prefix sums. An element's place in its block's packed run is

    base(tile) + popcount(word & ((1 << bit) - 1))

where ``word`` is the 32-bit half of the tile's bitmap holding the element and ``base`` is a 1-D
exclusive prefix sum of per-tile popcounts (D tiles for keys, 2 * ceil(D / 64) half-words per token
for values). ``popcount`` is one ``popc.b32`` instruction on CUDA (a bit-twiddling fallback under
``TRITON_INTERPRET=1``). Everything else (grid ``(B * Hkv, S + 1)`` with the dense window in the
last split, GQA rows of a KV head in one pass, online softmax in base 2, the combine kernel) is the
owner's design, imported from :mod:`.bitmap_attention` (the split count is chosen here: :func:`popc_splits`).

Entry point: :func:`bitmap_decode_attention_popc` ``(q, cache, scale=None, num_splits=None,
validate=True, num_warps=4) -> (out, lse)``; shapes and dtypes as
:func:`.bitmap_attention.bitmap_decode_attention` (q ``[B, H, Tq, D]``; out ``[B, H, Tq, D]``
float32, lse ``[B, H, Tq]`` float32).

The SpMV halves alone, for ``kvtool bench spmv``: :func:`bitmap_qk` (scores ``[B, H, Tc]`` of q
``[B, H, D]`` against compressed keys) and :func:`bitmap_pv` (``[B, H, D]`` from probabilities
``[B, H, Tc]`` and compressed values), with the same block expansion.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..attention import default_scale
from ..errors import UsageError
from .bitmap_attention import LOG2E, _combine_kernel, check_query
from .online_softmax import attend_block as _attend_block
from .bitmap_compress import _check_device
from .bitmap_layout import TILE, BitmapCache


@triton.jit
def _popc32(x, USE_ASM: tl.constexpr):
    """Set bits of each int32 (as int32): popc.b32 on CUDA, SWAR arithmetic otherwise."""
    if USE_ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        u = x.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        return ((u * 0x01010101) >> 24).to(tl.int32, bitcast=True)


@triton.jit
def _bitmap_attention_popc_kernel(
    q_ptr, kbm_ptr, knz_ptr, koff_ptr, vbm_ptr, vnz_ptr, voff_ptr, wk_ptr, wv_ptr, acc_ptr, m_ptr, l_ptr,
    scale_log2, Tc, W, D, DT, NB, R, BPS, S,
    RP: tl.constexpr, DP: tl.constexpr, DTP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.arange(0, RP)
    c = tl.arange(0, DP)
    t = tl.arange(0, 64)
    cmask = c < D
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + c[None, :], mask=(rows[:, None] < R) & cmask[None, :], other=0.0)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DP], tl.float32)
    if split < S:
        blk_start = split * BPS
        blk_end = tl.minimum(blk_start + BPS, NB)
        # keys: element (channel c, token t) is bit t of tile c's word
        k_upper = (t >= 32)[None, :]
        k_bit = (tl.full([64], 1, tl.int32) << (t % 32))[None, :]
        k_below = k_bit - 1
        # values: element (token t, channel c) is bit c % 64 of tile (t, c // 64)
        v_piece = (c % 64) // 32 + 2 * (c // 64)  # which 32-bit half-word of the token's bitmaps
        v_bit = (tl.full([DP], 1, tl.int32) << (c % 32))[None, :]
        v_below = v_bit - 1
        for blk in range(blk_start, blk_end):
            g = bh * NB + blk
            tok = blk * 64 + t
            tmask = tok < Tc
            klo = tl.load(kbm_ptr + (g * D + c) * 2, mask=cmask, other=0)
            khi = tl.load(kbm_ptr + (g * D + c) * 2 + 1, mask=cmask, other=0)
            pc_lo = _popc32(klo, USE_ASM)
            pc = pc_lo + _popc32(khi, USE_ASM)
            kbase = tl.cumsum(pc, axis=0) - pc + tl.load(koff_ptr + g)  # [DP] int64 after the add
            kword = tl.where(k_upper, khi[:, None], klo[:, None])
            kset = (kword & k_bit) != 0
            krank = _popc32(kword & k_below, USE_ASM) + tl.where(k_upper, pc_lo[:, None], 0)
            kt = tl.load(knz_ptr + (kbase[:, None] + krank), mask=kset, other=0.0)  # [DP, 64]

            vrow = bh * Tc + tok
            vword = tl.zeros([64, DP], tl.int32)
            vpre = tl.zeros([64, DP], tl.int32)
            run = tl.zeros([64], tl.int32)
            for p in tl.static_range(2 * DTP):
                w = tl.load(vbm_ptr + (vrow * DT + p // 2) * 2 + (p % 2), mask=tmask & (tl.full([64], p // 2, tl.int32) < DT), other=0)
                sel = (v_piece == p)[None, :]
                vword = tl.where(sel, w[:, None], vword)
                vpre = tl.where(sel, run[:, None], vpre)
                run += _popc32(w, USE_ASM)
            vbase = tl.cumsum(run, axis=0) - run + tl.load(voff_ptr + g)  # [64]
            vset = (vword & v_bit) != 0
            vrank = _popc32(vword & v_below, USE_ASM) + vpre
            v = tl.load(vnz_ptr + (vbase[:, None] + vrank), mask=vset, other=0.0)  # [64, DP]
            m_i, l_i, acc = _attend_block(q, kt, v, tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    else:
        for w0 in range(0, W, 64):
            tw = w0 + t
            wmask = tw < W
            kt = tl.load(wk_ptr + (bh * W + tw[None, :]) * D + c[:, None], mask=wmask[None, :] & cmask[:, None], other=0.0)
            v = tl.load(wv_ptr + (bh * W + tw[:, None]) * D + c[None, :], mask=wmask[:, None] & cmask[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, kt, v, wmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    slot = bh * (S + 1) + split
    tl.store(acc_ptr + (slot * RP + rows[:, None]) * DP + c[None, :], acc)
    tl.store(m_ptr + slot * RP + rows, m_i)
    tl.store(l_ptr + slot * RP + rows, l_i)


@triton.jit
def _expand_keys(kbm_ptr, knz_ptr, koff_ptr, g, c, cmask, D, bit3, below3, DP: tl.constexpr, USE_ASM: tl.constexpr):
    """Dense K^T tile ``[DP, 64]`` of key block ``g`` (channels x tokens, zeros where not stored)."""
    halves = tl.arange(0, 2)
    kw = tl.load(kbm_ptr + (g * D + c[:, None]) * 2 + halves[None, :], mask=cmask[:, None], other=0)  # [DP, 2]
    kpc = _popc32(kw, USE_ASM)
    kpre = tl.cumsum(kpc, axis=1) - kpc
    ktile = tl.sum(kpc, axis=1)
    kbase = tl.cumsum(ktile, axis=0) - ktile
    kw3 = kw[:, :, None]
    kset = (kw3 & bit3) != 0
    kpos = kbase[:, None, None] + kpre[:, :, None] + _popc32(kw3 & below3, USE_ASM)
    kblock = knz_ptr + tl.load(koff_ptr + g)
    return tl.reshape(tl.load(kblock + kpos, mask=kset, other=0.0), (DP, 64))


@triton.jit
def _expand_values(vbm_ptr, vnz_ptr, voff_ptr, g, vrow, tmask, DT, bit3, below3, DP: tl.constexpr, DTP: tl.constexpr, USE_ASM: tl.constexpr):
    """Dense V tile ``[64, DP]`` of value block ``g`` (tokens x channels); ``vrow`` = bh * Tc + token."""
    pieces = tl.arange(0, 2 * DTP)
    vw = tl.load(vbm_ptr + vrow[:, None] * (2 * DT) + pieces[None, :], mask=tmask[:, None] & (pieces[None, :] < 2 * DT), other=0)
    vpc = _popc32(vw, USE_ASM)
    vpre = tl.cumsum(vpc, axis=1) - vpc
    vtok = tl.sum(vpc, axis=1)
    vbase = tl.cumsum(vtok, axis=0) - vtok
    vw3 = vw[:, :, None]
    vset = (vw3 & bit3) != 0
    vpos = vbase[:, None, None] + vpre[:, :, None] + _popc32(vw3 & below3, USE_ASM)
    vblock = vnz_ptr + tl.load(voff_ptr + g)
    return tl.reshape(tl.load(vblock + vpos, mask=vset, other=0.0), (64, DP))


@triton.jit
def _bitmap_attention_popc3_kernel(
    q_ptr, kbm_ptr, knz_ptr, koff_ptr, vbm_ptr, vnz_ptr, voff_ptr, wk_ptr, wv_ptr, acc_ptr, m_ptr, l_ptr,
    scale_log2, Tc, W, D, DT, NB, R, BPS, S,
    RP: tl.constexpr, DP: tl.constexpr, DTP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
):
    """As :func:`_bitmap_attention_popc_kernel`, but the bit tensors are 3-D ``[rows, half-words, 32]``
    so that each element's half-word and its prefix come by broadcasting instead of select chains,
    and packed positions are int32 offsets from the block's start (one 64-bit add per block)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.arange(0, RP)
    c = tl.arange(0, DP)
    t = tl.arange(0, 64)
    cmask = c < D
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + c[None, :], mask=(rows[:, None] < R) & cmask[None, :], other=0.0)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DP], tl.float32)
    if split < S:
        blk_start = split * BPS
        blk_end = tl.minimum(blk_start + BPS, NB)
        i32 = tl.arange(0, 32)
        bit3 = (tl.full([32], 1, tl.int32) << i32)[None, None, :]
        below3 = bit3 - 1
        for blk in range(blk_start, blk_end):
            g = bh * NB + blk
            tok = blk * 64 + t
            tmask = tok < Tc
            kt = _expand_keys(kbm_ptr, knz_ptr, koff_ptr, g, c, cmask, D, bit3, below3, DP, USE_ASM)
            v = _expand_values(vbm_ptr, vnz_ptr, voff_ptr, g, bh * Tc + tok, tmask, DT, bit3, below3, DP, DTP, USE_ASM)
            m_i, l_i, acc = _attend_block(q, kt, v, tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    else:
        for w0 in range(0, W, 64):
            tw = w0 + t
            wmask = tw < W
            kt = tl.load(wk_ptr + (bh * W + tw[None, :]) * D + c[:, None], mask=wmask[None, :] & cmask[:, None], other=0.0)
            v = tl.load(wv_ptr + (bh * W + tw[:, None]) * D + c[None, :], mask=wmask[:, None] & cmask[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, kt, v, wmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    slot = bh * (S + 1) + split
    tl.store(acc_ptr + (slot * RP + rows[:, None]) * DP + c[None, :], acc)
    tl.store(m_ptr + slot * RP + rows, m_i)
    tl.store(l_ptr + slot * RP + rows, l_i)


def popc_splits(bh: int, blocks: int, device: torch.device) -> int:
    """Token-axis splits per KV head: about 4 programs per SM when there are few KV heads (under 32:
    batch 1 of an 8-KV-head model), else about 16, at least 2 blocks per program; 1 on the CPU.
    Measured on the H100 (Llama-3-8B shapes, 32k tokens, 70%): at batch 1, 4 per SM took 129 µs and
    16 per SM 191 µs (the combine walks the S + 1 partials serially); at batch 8, 16 per SM took
    567 µs and 4 per SM 631 µs."""
    if blocks == 0 or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = 4 if bh < 32 else 16
    return max(1, min(-(-blocks // 2), -(-per_sm * sms // max(bh, 1))))


def bitmap_decode_attention_popc(
    q: torch.Tensor,
    cache: BitmapCache,
    scale: float | None = None,
    num_splits: int | None = None,
    validate: bool = True,
    num_warps: int = 4,
    num_stages: int | None = None,
    variant: str = "3d",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, Tq, D]`` over ``cache`` (compressed tokens + dense window): the
    partial (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32). Same contract as
    :func:`.bitmap_attention.bitmap_decode_attention`; ``validate=False`` trusts the offsets.
    ``variant``: ``"3d"`` (broadcast half-words, int32 positions) or ``"2d"`` (select chains);
    ``num_warps`` / ``num_stages``: Triton launch options (None: Triton's default stages)."""
    if variant not in ("2d", "3d"):
        raise UsageError(f"variant must be '2d' or '3d', got {variant!r}")
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
    splits = popc_splits(bh, nb, q.device) if num_splits is None else int(num_splits)
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
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    use_asm = q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    empty = torch.zeros(1, dtype=q.dtype, device=q.device)
    kernel = _bitmap_attention_popc3_kernel if variant == "3d" else _bitmap_attention_popc_kernel
    extra = {} if num_stages is None else {"num_stages": num_stages}
    kernel[(bh, splits + 1)](
        q.contiguous(), k.bitmaps.view(torch.int32), k.nz if k.nz.numel() else empty, k.offsets,
        v.bitmaps.view(torch.int32), v.nz if v.nz.numel() else empty, v.offsets,
        cache.window_keys.contiguous() if w else empty, cache.window_values.contiguous() if w else empty,
        acc, m, l, float(scale) * LOG2E, k.tokens, w, d, -(-d // TILE), nb, rows, bps, splits,
        RP=rp, DP=dp, DTP=dp // TILE, DOT_PREC=prec, UPCAST=upcast, USE_ASM=use_asm, num_warps=num_warps, **extra,
    )
    _combine_kernel[(bh,)](acc, m, l, out, lse, rows, d, splits, RP=rp, DP=dp, num_warps=4)
    return out, lse


@triton.jit
def _bitmap_qk_kernel(q_ptr, kbm_ptr, knz_ptr, koff_ptr, s_ptr, Tc, D, NB, R, RP: tl.constexpr, DP: tl.constexpr, USE_ASM: tl.constexpr):
    """Scores of one key block: s[bh, r, blk*64 + t] = q[bh, r] . K[t] (fp32), all R query rows."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    rows = tl.arange(0, RP)
    c = tl.arange(0, DP)
    t = tl.arange(0, 64)
    cmask = c < D
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + c[None, :], mask=(rows[:, None] < R) & cmask[None, :], other=0.0)
    bit3 = (tl.full([32], 1, tl.int32) << tl.arange(0, 32))[None, None, :]
    kt = _expand_keys(kbm_ptr, knz_ptr, koff_ptr, bh * NB + blk, c, cmask, D, bit3, bit3 - 1, DP, USE_ASM)
    s = tl.dot(q, kt)
    tok = blk * 64 + t
    tl.store(s_ptr + (bh * R + rows[:, None]) * Tc + tok[None, :], s, mask=(rows[:, None] < R) & (tok[None, :] < Tc))


@triton.jit
def _bitmap_pv_kernel(p_ptr, vbm_ptr, vnz_ptr, voff_ptr, o_ptr, Tc, D, DT, NB, R, BPS,
                      RP: tl.constexpr, DP: tl.constexpr, DTP: tl.constexpr, USE_ASM: tl.constexpr):
    """Partial P.V of a split of value blocks: o[bh, split, r] = sum_t p[bh, r, t] V[t] (fp32)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.arange(0, RP)
    c = tl.arange(0, DP)
    t = tl.arange(0, 64)
    bit3 = (tl.full([32], 1, tl.int32) << tl.arange(0, 32))[None, None, :]
    acc = tl.zeros([RP, DP], tl.float32)
    for blk in range(split * BPS, tl.minimum(split * BPS + BPS, NB)):
        tok = blk * 64 + t
        tmask = tok < Tc
        p = tl.load(p_ptr + (bh * R + rows[:, None]) * Tc + tok[None, :], mask=(rows[:, None] < R) & tmask[None, :], other=0.0)
        v = _expand_values(vbm_ptr, vnz_ptr, voff_ptr, bh * NB + blk, bh * Tc + tok, tmask, DT, bit3, bit3 - 1, DP, DTP, USE_ASM)
        acc += tl.dot(p, v)
    nsplit = tl.num_programs(1)
    tl.store(o_ptr + ((bh * nsplit + split) * RP + rows[:, None]) * DP + c[None, :], acc)


def _use_asm(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def bitmap_qk(q: torch.Tensor, keys) -> torch.Tensor:
    """Scores ``[B, H, Tc]`` float32 (unscaled q·Kᵀ) of q ``[B, H, D]`` (keys' dtype) against the
    bitmap-compressed keys (:class:`~.bitmap_layout.BitmapTensor`, kind ``keys``, ``[B, Hkv, Tc, D]``).
    One program per (batch x KV head, 64-token block); the G query heads of a KV head share it."""
    if keys.kind != "keys":
        raise UsageError(f"bitmap_qk needs compressed keys, got {keys.kind}")
    b, h, d = q.shape
    hkv, tc = keys.kv_heads, keys.tokens
    if b != keys.batch or d != keys.head_dim or h % hkv or q.dtype != keys.dtype:
        raise UsageError(f"q is {q.dtype} {list(q.shape)}; expected {keys.dtype} [{keys.batch}, a multiple of {hkv}, {keys.head_dim}]")
    _check_device(q, "q")
    rows = h // hkv
    out = torch.empty(b, h, tc, dtype=torch.float32, device=q.device)
    if tc == 0:
        return out
    rp, dp = max(16, triton.next_power_of_2(rows)), max(64, triton.next_power_of_2(d))
    _bitmap_qk_kernel[(b * hkv, keys.blocks)](q.contiguous(), keys.bitmaps.view(torch.int32), keys.nz, keys.offsets, out, tc, d,
                                              keys.blocks, rows, RP=rp, DP=dp, USE_ASM=_use_asm(q), num_warps=4)
    return out


def bitmap_pv(p: torch.Tensor, values, num_splits: int | None = None) -> torch.Tensor:
    """Output ``[B, H, D]`` float32 = p ``[B, H, Tc]`` (values' dtype) · the bitmap-compressed values
    (:class:`~.bitmap_layout.BitmapTensor`, kind ``values``). Grid (batch x KV head, splits of the
    token blocks); the split partials are summed with one torch reduction."""
    if values.kind != "values":
        raise UsageError(f"bitmap_pv needs compressed values, got {values.kind}")
    b, h, tc = p.shape
    hkv, d = values.kv_heads, values.head_dim
    if b != values.batch or tc != values.tokens or h % hkv or p.dtype != values.dtype:
        raise UsageError(f"p is {p.dtype} {list(p.shape)}; expected {values.dtype} [{values.batch}, a multiple of {hkv}, {values.tokens}]")
    _check_device(p, "p")
    rows = h // hkv
    nb = values.blocks
    if tc == 0:
        return torch.zeros(b, h, d, dtype=torch.float32, device=p.device)
    splits = popc_splits(b * hkv, nb, p.device) if num_splits is None else int(num_splits)
    bps = max(1, -(-nb // max(1, splits)))
    splits = max(1, -(-nb // bps))
    rp, dp = max(16, triton.next_power_of_2(rows)), max(64, triton.next_power_of_2(d))
    part = torch.empty(b * hkv, splits, rp, dp, dtype=torch.float32, device=p.device)
    _bitmap_pv_kernel[(b * hkv, splits)](p.contiguous(), values.bitmaps.view(torch.int32), values.nz, values.offsets, part, tc, d,
                                         -(-d // TILE), nb, rows, bps, RP=rp, DP=dp, DTP=dp // TILE, USE_ASM=_use_asm(p), num_warps=4)
    return part.sum(1)[:, :rows, :d].reshape(b, h, d)
