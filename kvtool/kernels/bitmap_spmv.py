"""The two SpMV halves of bitmap attention alone, for ``kvtool bench spmv`` (Triton): q·Kᵀ against
bitmap-compressed keys and P·V against bitmap-compressed values, with the block expansions of
:mod:`.bitmap_attention` (on CUDA with 16-bit data the per-word bit walk ``_expand_keys_walk`` /
``_expand_values_walk`` and a 128-register cap, otherwise ``_expand_keys`` / ``_expand_values``).

- :func:`bitmap_qk` (q ``[B, H, D]``, compressed keys ``[B, Hkv, Tc, D]``) -> scores ``[B, H, Tc]``
  float32 (unscaled).
- :func:`bitmap_pv` (p ``[B, H, Tc]``, compressed values) -> ``[B, H, D]`` float32.

References: the dense products of the decoded tensors (``BitmapTensor.decode()``), as the tests do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.core.errors import UsageError
from kvtool.kernels.bitmap_attention import (
    _expand_keys,
    _expand_keys_walk,
    _expand_values,
    _expand_values_walk,
    default_splits,
    expansion_options,
)
from kvtool.kernels.common import check_device
from kvtool.kernels.bitmap_layout import TILE


@triton.jit
def _bitmap_qk_kernel(q_ptr, kbm_ptr, knz_ptr, koff_ptr, s_ptr, Tc, D, NB, R, RP: tl.constexpr, DP: tl.constexpr, USE_ASM: tl.constexpr, WALK: tl.constexpr):
    """Scores of one key block: s[bh, r, blk*64 + t] = q[bh, r] . K[t] (fp32), all R query rows."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    rows = tl.arange(0, RP)
    c = tl.arange(0, DP)
    t = tl.arange(0, 64)
    cmask = c < D
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + c[None, :], mask=(rows[:, None] < R) & cmask[None, :], other=0.0)
    if WALK != "":
        kt = _expand_keys_walk(kbm_ptr, knz_ptr, koff_ptr, bh * NB + blk, c, cmask, D, DP, WALK)
    else:
        bit3 = (tl.full([32], 1, tl.int32) << tl.arange(0, 32))[None, None, :]
        kt = _expand_keys(kbm_ptr, knz_ptr, koff_ptr, bh * NB + blk, c, cmask, D, bit3, bit3 - 1, DP, USE_ASM)
    s = tl.dot(q, kt)
    tok = blk * 64 + t
    tl.store(s_ptr + (bh * R + rows[:, None]) * Tc + tok[None, :], s, mask=(rows[:, None] < R) & (tok[None, :] < Tc))


@triton.jit
def _bitmap_pv_kernel(p_ptr, vbm_ptr, vnz_ptr, voff_ptr, o_ptr, Tc, D, DT, NB, R, BPS,
                      RP: tl.constexpr, DP: tl.constexpr, DTP: tl.constexpr, USE_ASM: tl.constexpr, WALK: tl.constexpr):
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
        if WALK != "":
            v = _expand_values_walk(vbm_ptr, vnz_ptr, voff_ptr, bh * NB + blk, bh * Tc + tok, tmask, DT, DP, DTP, WALK)
        else:
            v = _expand_values(vbm_ptr, vnz_ptr, voff_ptr, bh * NB + blk, bh * Tc + tok, tmask, DT, bit3, bit3 - 1, DP, DTP, USE_ASM)
        acc += tl.dot(p, v)
    nsplit = tl.num_programs(1)
    tl.store(o_ptr + ((bh * nsplit + split) * RP + rows[:, None]) * DP + c[None, :], acc)


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
    check_device(q=q)
    rows = h // hkv
    out = torch.empty(b, h, tc, dtype=torch.float32, device=q.device)
    if tc == 0:
        return out
    rp, dp = max(16, triton.next_power_of_2(rows)), max(64, triton.next_power_of_2(d))
    _bitmap_qk_kernel[(b * hkv, keys.blocks)](q.contiguous(), keys.bitmaps.view(torch.int32), keys.nz, keys.offsets, out, tc, d,
                                              keys.blocks, rows, RP=rp, DP=dp, num_warps=4, **expansion_options(q, dp))
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
    check_device(p=p)
    rows = h // hkv
    nb = values.blocks
    if tc == 0:
        return torch.zeros(b, h, d, dtype=torch.float32, device=p.device)
    splits = default_splits(b * hkv, nb, p.device) if num_splits is None else int(num_splits)
    bps = max(1, -(-nb // max(1, splits)))
    splits = max(1, -(-nb // bps))
    rp, dp = max(16, triton.next_power_of_2(rows)), max(64, triton.next_power_of_2(d))
    part = torch.empty(b * hkv, splits, rp, dp, dtype=torch.float32, device=p.device)
    _bitmap_pv_kernel[(b * hkv, splits)](p.contiguous(), values.bitmaps.view(torch.int32), values.nz, values.offsets, part, tc, d,
                                         -(-d // TILE), nb, rows, bps, RP=rp, DP=dp, DTP=dp // TILE, num_warps=4, **expansion_options(p, dp))
    return part.sum(1)[:, :rows, :d].reshape(b, h, d)
