"""Decode attention over a KIVI cache (the ``quant`` format, scheme kivi) read as stored: packed
low-bit key codes with a scale and zero point per channel and group of tokens, packed value codes
with a scale and zero point per token and group of channels, and the full-precision residual
tokens; beside a plain-torch reference of the same maths.

Entry points (B batch, H query heads, Hkv KV heads, G = H / Hkv, Tq query tokens, D head_dim; dt =
float16 / bfloat16 / float32, the cache dtype):

- :func:`kivi_attention` ``(q, cache, scale=None) -> (out, lse)``, the partial of
  :mod:`kvtool.core.attention`: q ``[B, H, Tq, D]`` dt (any strides), out ``[B, H, Tq, D]`` float32,
  lse ``[B, H, Tq]`` float32 (natural log; 0 / -inf when the cache holds no token). No masks: every
  token held is attended.
- :func:`kivi_attention_reference`: the same in torch (dequantise the tokens in use, then
  :func:`~kvtool.core.attention.attend_partial`).
- :func:`cache_from_encoded`: a :class:`KiviCache` over an encoded layer's tensors (no copies).

The cache (:class:`KiviCache`; the layout of :mod:`kvtool.formats.quant`, each tensor allowed to be
allocated for more tokens than are in use): ``lengths`` int32 ``[4]`` on the device holds Tk, Tv
(tokens whose keys / values are quantised) and nk, nv (residual keys / values in use), with
Tk + nk = Tv + nv = T. Token t's key is the dequantised code t when t < Tk, else residual key
t - Tk; its value likewise against Tv. A live layer that grows writes a new token at residual
index nk / nv on the device and adds 1 to both lengths, and joins a quantised group by writing its
codes and scales at token Tk (Tv) and moving the lengths (:class:`kvtool.formats.quant.QuantLive`):
no shapes change, so a call captured in a CUDA graph stays valid while tokens join.

The kernel (:func:`_kivi_kernel`): one program per (split of the tokens, batch x KV head, block of
query rows); the G x Tq query rows of a KV head (padded to 16) share one read of its data. Tokens
go in blocks of BT (64, or the group when it is 16 or 32, so that each block lies inside one key
group): a block's packed key bytes ``[D, BT * bits / 8]`` and value bytes ``[BT, D * bits / 8]``
are each loaded once, unpacked with shifts in registers, dequantised as the format decodes them
(``code * scale + zero`` in float32, rounded to dt) and fed to ``tl.dot`` on the tensor cores
(:func:`~kvtool.kernels.online_softmax.attend_block`). Key scales are one per channel per block;
value scales one per token when ``group >= D``, else gathered per element (L1 hits). Blocks
below min(Tk, Tv) take a path without masks or residual loads; the last blocks mix codes and
residual tokens. The splits (about 4 programs per SM, planned from the tensors' capacity) share
the T tokens in use, read from ``lengths`` by each program, so no host sync is needed and one
captured launch serves every length up to the capacity; their partials are merged by
:func:`~kvtool.kernels.online_softmax.merge_split_partials`.

Why ``tl.dot`` rather than dequantised products on the CUDA cores: at the card's bandwidth a 4-bit
cache delivers about 6.7e12 elements per second on an H100 (3.35 TB/s at half a byte each), which
leaves a few instructions per element for unpacking and dequantising; G multiply-adds per element
on top would make the kernel bound by instruction issue, while one MMA covers the G rows (padded
to 16) of a whole tile. On float16 caches :func:`kivi_attention` takes the packed-codes Triton
kernel below or, where it serves the call, the CUDA kernel of ``kivi_decode.cuh``, which
dequantises the codes in the MMA's operand registers (docs/decode.md has both and their timings).

Kernels sit below the formats: the cache is read through plain tensors and ints, never a format
class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvtool.core.attention import attend_partial, default_scale
from kvtool.core.errors import BadDataError, UsageError
from kvtool.kernels.common import LOG2E, EncodedLike, check_device, check_query, cuda_extension, dot_flags, interpreting, note, num_splits
from kvtool.kernels.online_softmax import attend_block, merge_split_partials, store_split_partial

BITS = (2, 4, 8)
BACKENDS = ("auto", "cuda", "triton")
_CUDA_SOURCES = [Path(__file__).with_name("kivi_decode.cu"), Path(__file__).with_name("kivi_decode_swapped.cu")]
CUDA_WARPS = 4  # warps per CUDA block: each one is a split of its own
# The CUDA kernels: "swapped" (kivi_decode_swapped.cuh: the codes as the MMA's A operand, for at most 8
# query rows per KV head; the 16-row kernel beyond) or "rows16" (kivi_decode.cuh's kernel always).
CUDA_KERNELS = {"swapped": 0, "rows16": 1}


def cuda_kernel() -> str:
    """The CUDA kernel the backend launches: ``$KVTOOL_KIVI_CUDA_KERNEL`` (``swapped``, the default, or
    ``rows16``: the kernel before it, kept to compare them in one run)."""
    name = os.environ.get("KVTOOL_KIVI_CUDA_KERNEL", "swapped")
    if name not in CUDA_KERNELS:
        raise UsageError(f"KVTOOL_KIVI_CUDA_KERNEL must be one of {', '.join(CUDA_KERNELS)}, not {name!r}")
    return name


@dataclass
class KiviCache:
    """One layer's KIVI tensors (module docstring). ``key_codes`` uint8 ``[B, Hkv, D, >= Tk * bits / 8]``;
    ``key_scales`` / ``key_zeros`` ``[B, Hkv, D, >= Tk / group]`` (either axis of the last two
    contiguous; :func:`cache_from_encoded` and the live layer hold them group-major, see
    :func:`group_major`); ``value_codes`` uint8
    ``[B, Hkv, >= Tv, ceil(D * bits / 8)]``; ``value_scales`` / ``value_zeros``
    ``[B, Hkv, >= Tv, ceil(D / group)]`` (float16 or float32); ``residual_keys`` / ``residual_values``
    ``[B, Hkv, >= nk / nv, D]`` in the cache dtype; ``lengths`` int32 ``[4]`` (Tk, Tv, nk, nv) on the
    same device. Each tensor contiguous in its last axis, batch and head axes packed (``stride(0) ==
    Hkv * stride(1)``), but the key scales and zero points, which may be group-major."""

    key_codes: torch.Tensor
    key_scales: torch.Tensor
    key_zeros: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    value_zeros: torch.Tensor
    residual_keys: torch.Tensor
    residual_values: torch.Tensor
    lengths: torch.Tensor
    bits: int
    group: int

    @property
    def dtype(self) -> torch.dtype:
        return self.residual_keys.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, Hkv, D)."""
        b, h, _, d = self.residual_keys.shape
        return b, h, d

    @property
    def capacity(self) -> int:
        """The most tokens the tensors can hold (what the splits are planned for)."""
        keys = self.key_scales.shape[3] * self.group + self.residual_keys.shape[2]
        values = self.value_codes.shape[2] + self.residual_values.shape[2]
        return min(keys, values)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.key_codes, self.key_scales, self.key_zeros, self.value_codes, self.value_scales, self.value_zeros,
                self.residual_keys, self.residual_values)


def cache_from_encoded(enc: EncodedLike) -> KiviCache:
    """A :class:`KiviCache` over the tensors of an encoded ``quant`` layer of scheme kivi (no
    copies of contiguous tensors); its lengths from the metadata, on the tensors' device."""
    t, m = enc.tensors, enc.meta
    if m.get("scheme") != "kivi":
        raise UsageError(f"the KIVI kernel reads scheme kivi layers, not {m.get('scheme')!r}")
    b, h, total, d = m["shape"]
    tk, tv = int(m["key_tokens"]), int(m["value_tokens"])
    dev = t["residual.keys"].device
    lengths = torch.tensor([tk, tv, total - tk, total - tv], dtype=torch.int32, device=dev)
    c = {n: x.contiguous() for n, x in t.items()}
    for n in ("scales.keys", "zeros.keys"):  # group-major: a block reads one group's scales of every channel in a row
        c[n] = group_major(c[n])
    return KiviCache(c["codes.keys"], c["scales.keys"], c["zeros.keys"], c["codes.values"], c["scales.values"], c["zeros.values"],
                     c["residual.keys"], c["residual.values"], lengths, int(m["bits"]), int(m["group"]))


def group_major(x: torch.Tensor) -> torch.Tensor:
    """Key scales or zero points ``[B, Hkv, D, groups]`` laid out group by group (channels
    contiguous, the same shape): what a block of tokens reads of them, one group for every
    channel, is then one run of 2 x D bytes instead of D scattered ones."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def block_tokens(group: int) -> tuple[int, bool]:
    """(tokens per block, whether each block lies inside one key group): the largest power of two
    from 16 to 64 that divides ``group``, else 64 with key scales gathered per element."""
    low = group & -group
    if low >= 16:
        return min(64, low), True
    return 64, False


def check_cache(q: torch.Tensor, cache: KiviCache) -> None:
    """Shapes, dtypes and devices of ``cache`` against each other and q; UsageError naming the
    first tensor that disagrees (host-side checks only: no sync)."""
    if cache.bits not in BITS:
        raise UsageError(f"KIVI codes have 2, 4 or 8 bits, not {cache.bits}")
    if cache.group < 1:
        raise UsageError(f"KIVI group must be at least 1, got {cache.group}")
    if cache.residual_keys.ndim != 4:
        raise UsageError(f"residual keys must be [batch, kv_heads, tokens, head_dim], got {list(cache.residual_keys.shape)}")
    b, h, d = cache.shape
    ngv = -(-d // cache.group)
    nbv = -(-d * cache.bits // 8)
    want = {
        "key_codes": ((b, h, d), torch.uint8), "value_codes": ((b, h, None, nbv), torch.uint8),
        "key_scales": ((b, h, d), None), "key_zeros": ((b, h, d), None),
        "value_scales": ((b, h, None, ngv), None), "value_zeros": ((b, h, None, ngv), None),
        "residual_values": ((b, h, None, d), cache.dtype),
    }
    for name, (shape, dt) in want.items():
        x = getattr(cache, name)
        ok = x.ndim == 4 and all(s is None or x.shape[i] == s for i, s in enumerate(shape)) and (dt is None or x.dtype == dt)
        if dt is None:
            ok = ok and x.dtype in (torch.float16, torch.float32)
        inner = x.stride(3) == 1 or (name in ("key_scales", "key_zeros") and x.stride(2) == 1)  # key scales: either axis
        if not ok or not inner or x.stride(0) != h * x.stride(1):
            raise UsageError(f"{name} is {x.dtype} {list(x.shape)} (strides {list(x.stride())}); expected {list(shape)} "
                             f"with the last axis contiguous")
    if cache.key_scales.shape != cache.key_zeros.shape or cache.value_scales.shape != cache.value_zeros.shape:
        raise UsageError("scales and zero points must have one shape")
    if cache.key_scales.stride() != cache.key_zeros.stride():
        raise UsageError("key scales and zero points must have one layout")
    if cache.key_codes.shape[3] * 8 < cache.key_scales.shape[3] * cache.group * cache.bits:
        raise UsageError(f"key_codes hold {cache.key_codes.shape[3]} bytes per channel, fewer than the {cache.key_scales.shape[3]} groups need")
    if cache.value_scales.shape[2] < cache.value_codes.shape[2]:
        raise UsageError("value_scales hold fewer tokens than value_codes")
    rk = cache.residual_keys
    if rk.stride(3) != 1 or rk.stride(0) != h * rk.stride(1):
        raise UsageError(f"residual_keys must have its last axis contiguous, strides {list(rk.stride())}")
    if cache.lengths.dtype != torch.int32 or tuple(cache.lengths.shape) != (4,):
        raise UsageError(f"lengths must be int32 [4] (Tk, Tv, nk, nv), got {cache.lengths.dtype} {list(cache.lengths.shape)}")
    check_query(q, b, h, d, cache.dtype)
    check_device(q=q, lengths=cache.lengths, **dict(zip(("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales",
                                                         "value_zeros", "residual_keys", "residual_values"), cache.tensors())))


# ----------------------------------------------------------------------------- the kernel


@triton.jit
def _unpack(byte, ROWS: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr):
    """uint8 ``[ROWS, NB]`` packed codes -> float32 ``[ROWS, NB * 8 // BITS]``: code j of byte n
    (bits ``j * BITS`` up) at column ``n * (8 // BITS) + j``, the order of ``pack_codes``."""
    x = byte.to(tl.int32)
    if BITS == 8:
        out = x.to(tl.float32)
    else:
        PER: tl.constexpr = 8 // BITS
        sh = tl.arange(0, PER) * BITS
        codes = (x[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)
        out = tl.reshape(codes, (ROWS, NB * PER)).to(tl.float32)
    return out


@triton.jit
def _rounded(x, like, UPCAST: tl.constexpr):
    """float32 x rounded to the dtype of ``like`` (nearest even), as the format's decode rounds its
    dequantised numbers. UPCAST (bfloat16 on the CPU interpreter, whose float32 -> bfloat16 cast
    truncates) rounds with integer arithmetic and keeps float32 storage."""
    if UPCAST:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = x.to(like.dtype)
    return out


@triton.jit
def _key_tile(kc_ptr, ks_ptr, kz_ptr, rk_ptr, bh, t0, c, cmask, Tk, T, kc_bh, kc_c, ks_bh, ks_c, ks_g, rk_bh, rk_t, like,
              BT: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SCALES: tl.constexpr,
              EVEN_D: tl.constexpr, FULL: tl.constexpr, UPCAST: tl.constexpr):
    """Keys of tokens t0 .. t0 + BT - 1 transposed, ``[DP, BT]`` in q's dtype (float32 under UPCAST).
    FULL: every token of the block is a quantised key (no masks but the channels', no residual)."""
    NB: tl.constexpr = BT * BITS // 8
    t = t0 + tl.arange(0, BT)
    j = tl.arange(0, NB)
    quant = t < Tk
    kb = kc_ptr + bh * kc_bh + c[:, None] * kc_c + (t0 * BITS) // 8 + j[None, :]
    if FULL:
        if EVEN_D:
            byte = tl.load(kb)
        else:
            byte = tl.load(kb, mask=cmask[:, None], other=0)
    else:
        byte = tl.load(kb, mask=cmask[:, None] & ((t0 + j * (8 // BITS)) < Tk)[None, :], other=0)
    codes = _unpack(byte, DP, NB, BITS)
    if BLOCK_SCALES:  # the block lies inside one group: one scale and zero point per channel
        sp = ks_bh * bh + c * ks_c + (t0 // GROUP) * ks_g
        if FULL:
            if EVEN_D:
                s = tl.load(ks_ptr + sp).to(tl.float32)
                z = tl.load(kz_ptr + sp).to(tl.float32)
            else:
                s = tl.load(ks_ptr + sp, mask=cmask, other=0.0).to(tl.float32)
                z = tl.load(kz_ptr + sp, mask=cmask, other=0.0).to(tl.float32)
        else:
            smask = cmask & ((c * 0 + t0) < Tk)  # a vector mask (a scalar one is not a mask to the interpreter)
            s = tl.load(ks_ptr + sp, mask=smask, other=0.0).to(tl.float32)
            z = tl.load(kz_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        k = codes * s[:, None] + z[:, None]
    else:
        sp = ks_bh * bh + c[:, None] * ks_c + (t // GROUP)[None, :] * ks_g
        smask = cmask[:, None] & quant[None, :]
        s = tl.load(ks_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        z = tl.load(kz_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        k = codes * s + z
    k = _rounded(k, like, UPCAST)
    if not FULL:
        rmask = (t >= Tk) & (t < T)
        r = tl.load(rk_ptr + rk_bh * bh + (t - Tk)[None, :] * rk_t + c[:, None], mask=cmask[:, None] & rmask[None, :], other=0.0)
        k = tl.where(quant[None, :], k, r.to(k.dtype))
    return k


@triton.jit
def _value_tile(vc_ptr, vs_ptr, vz_ptr, rv_ptr, bh, t0, c, cmask, Tv, T, vc_bh, vc_t, vs_bh, vs_t, rv_bh, rv_t, NBYTES, like,
                BT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, NGV: tl.constexpr, DP: tl.constexpr,
                EVEN_D: tl.constexpr, FULL: tl.constexpr, UPCAST: tl.constexpr):
    """Values of tokens t0 .. t0 + BT - 1, ``[BT, DP]`` in q's dtype (float32 under UPCAST); NBYTES
    packed bytes per token. FULL: every token of the block is a quantised value."""
    NB: tl.constexpr = DP * BITS // 8
    t = t0 + tl.arange(0, BT)
    j = tl.arange(0, NB)
    quant = t < Tv
    row = vc_ptr + vc_bh * bh + t[:, None] * vc_t + j[None, :]
    if FULL:
        if EVEN_D:
            byte = tl.load(row)
        else:
            byte = tl.load(row, mask=(j < NBYTES)[None, :], other=0)
    else:
        byte = tl.load(row, mask=quant[:, None] & (j < NBYTES)[None, :], other=0)
    codes = _unpack(byte, BT, NB, BITS)
    if NGV == 1:  # one scale and zero point per token
        sp = vs_bh * bh + t * vs_t
        smask = quant
        s = tl.load(vs_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        z = tl.load(vz_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        v = codes * s[:, None] + z[:, None]
    else:  # a scale per token and group of channels, gathered per element (L1 hits)
        sp = vs_bh * bh + t[:, None] * vs_t + (c // GROUP)[None, :]
        smask = quant[:, None] & cmask[None, :]
        s = tl.load(vs_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        z = tl.load(vz_ptr + sp, mask=smask, other=0.0).to(tl.float32)
        v = codes * s + z
    v = _rounded(v, like, UPCAST)
    if not FULL:
        rmask = (t >= Tv) & (t < T)
        r = tl.load(rv_ptr + rv_bh * bh + (t - Tv)[:, None] * rv_t + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        v = tl.where(quant[:, None], v, r.to(v.dtype))
    return v


@triton.jit
def _kivi_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, rk_ptr, rv_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
    scale_log2, S, HKV, TQ, R, NBYTES,
    sq_b, sq_h, sq_t, kc_bh, kc_c, ks_bh, ks_c, ks_g, vc_bh, vc_t, vs_bh, vs_t, rk_bh, rk_t, rv_bh, rv_t,
    G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, RB: tl.constexpr, RP: tl.constexpr, BT: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SCALES: tl.constexpr, NGV: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, FROM_BT: tl.constexpr = 0, SLOTS: tl.constexpr = 0,
):
    """One program: split ``program_id(0)`` of the tokens in use, KV head ``program_id(1)`` (batch x
    Hkv), query rows ``program_id(2) * RB ..`` (row r = query head g * TQ + query token). Writes
    its unnormalised partial (acc, base-2 max, sum) at slot ``bh * S + split``. FROM_BT > 0: the
    tail kernel of :func:`_kivi_packed_kernel`: only the tokens from min(Tk, Tv) rounded down to
    FROM_BT on (the blocks the packed kernel leaves), split S ways, written at slot
    ``bh * SLOTS + SLOTS - S + split``."""
    pid_s = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pid_r = tl.program_id(2)
    b = bh // HKV
    kh = bh % HKV
    EVEN_D: tl.constexpr = D == DP
    c = tl.arange(0, DP)
    cmask = c < D
    rows = pid_r * RB + tl.arange(0, RB)
    rmask = rows < R
    qh = kh * G + rows // TQ
    q = tl.load(q_ptr + b * sq_b + qh[:, None] * sq_h + (rows % TQ)[:, None] * sq_t + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    tk = tl.load(len_ptr)
    tv = tl.load(len_ptr + 1)
    nk = tl.load(len_ptr + 2)
    T = tk + nk
    first = 0
    if FROM_BT > 0:
        first = tl.minimum(tk, tv) // FROM_BT * FROM_BT
    blocks = tl.cdiv(T - first, BT)
    per = tl.cdiv(blocks, S)
    start = first + pid_s * per * BT
    end = tl.minimum(start + per * BT, T)
    qend = tl.minimum(end, tl.minimum(tk, tv) // BT * BT)  # blocks whose keys and values are all codes
    m_i = tl.full([RB], float("-inf"), tl.float32)
    l_i = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, DP], tl.float32)
    every = tl.full([1, BT], 1, tl.int1)
    for t0 in range(start, qend, BT):
        kt = _key_tile(kc_ptr, ks_ptr, kz_ptr, rk_ptr, bh, t0, c, cmask, tk, T, kc_bh, kc_c, ks_bh, ks_c, ks_g, rk_bh, rk_t, q,
                       BT, DP, BITS, GROUP, BLOCK_SCALES, EVEN_D, True, UPCAST)
        v = _value_tile(vc_ptr, vs_ptr, vz_ptr, rv_ptr, bh, t0, c, cmask, tv, T, vc_bh, vc_t, vs_bh, vs_t, rv_bh, rv_t, NBYTES, q,
                        BT, BITS, GROUP, NGV, DP, EVEN_D, True, UPCAST)
        m_i, l_i, acc = attend_block(q, kt, v, every, m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    for t0 in range(tl.maximum(start, qend), end, BT):
        kt = _key_tile(kc_ptr, ks_ptr, kz_ptr, rk_ptr, bh, t0, c, cmask, tk, T, kc_bh, kc_c, ks_bh, ks_c, ks_g, rk_bh, rk_t, q,
                       BT, DP, BITS, GROUP, BLOCK_SCALES, EVEN_D, False, UPCAST)
        v = _value_tile(vc_ptr, vs_ptr, vz_ptr, rv_ptr, bh, t0, c, cmask, tv, T, vc_bh, vc_t, vs_bh, vs_t, rv_bh, rv_t, NBYTES, q,
                        BT, BITS, GROUP, NGV, DP, EVEN_D, False, UPCAST)
        live = (t0 + tl.arange(0, BT)) < T
        m_i, l_i, acc = attend_block(q, kt, v, live[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    slot = bh * S + pid_s
    if SLOTS > 0:
        slot = bh * SLOTS + SLOTS - S + pid_s
    store_split_partial(acc_ptr, m_ptr, l_ptr, slot, rows, rmask, c, acc, m_i, l_i, RP, DP)


# ----------------------------------------------------------------------------- the packed-codes kernel
#
# Codes become float16 with integer and half2 instructions only (no int->float or float->half
# conversions, which run at a quarter of the ALU rate): a code c placed in the mantissa of 1024.0
# (bits 0x6400 | c) reads as 1024 + c; a code shifted up by k bits reads as 1024 + 2^k c, and one
# fused multiply-add by 2^-k and -1024 * 2^-k gives c exactly. A second fma.rn.f16x2 gives
# c * scale + zero with one rounding of the exact value; the format's float32 maths rounded to
# float16 rounds twice (the product is exact in float32, the sum is not always), so the tiles are
# the reference's but at rare double-rounding ties.

def _dequant_asm(bits: int) -> tuple[str, str]:
    """(PTX, constraints) of one inline-asm call over 4 packed bytes: outputs, per code j of a byte,
    two f16x2 words (bytes 0-1 and 2-3); inputs the 4 bytes as one word, the 4 scales and the 4
    zero points as two f16x2 words each (the 4 bytes may lie in different groups: Triton packs the
    elements a thread holds, whatever their positions), and the per-code constants (mask,
    multiplier, addend) as int32 operands, so that they stay in registers across calls."""
    per = 8 // bits
    inp = 2 * per
    sc, ze, k0 = inp + 1, inp + 3, inp + 5  # an int32 operand takes one register per packed element
    lines = ["{", ".reg .b32 t<2>, x;", f"prmt.b32 t0, ${inp}, 0, 0x4140;", f"prmt.b32 t1, ${inp}, 0, 0x4342;"]
    for j in range(per):
        mask, mul, add = k0 + 3 * 4 * j, k0 + (3 * j + 1) * 4, k0 + (3 * j + 2) * 4
        for half in range(2):
            lines += [f"lop3.b32 x, t{half}, ${mask}, 0x64006400, 0xEA;",  # (t & mask) | 0x6400: 1024 + code << k
                      f"fma.rn.f16x2 x, x, ${mul}, ${add};",  # the code, exactly
                      f"fma.rn.f16x2 ${2 * j + half}, x, ${sc + half}, ${ze + half};"]  # code * scale + zero, one rounding
    lines.append("}")
    constraints = ",".join(["=r"] * (2 * per) + ["r"] * (1 + 4 + 12 * per))
    return "\n".join(lines), constraints


_ASM = {bits: _dequant_asm(bits) for bits in (2, 4, 8)}


@triton.jit
def _codes_f16(byte, s, z, BITS: tl.constexpr, ASM: tl.constexpr):
    """uint8 ``[A, NG, NB]`` packed codes with float16 scales / zero points ``[A, NG, 1]`` ->
    float16 ``[A, NG * NB * 8 // BITS]``, code j of byte n at column ``n * (8 // BITS) + j`` of its
    group (the order of ``pack_codes``), each ``round_f16(code * scale + zero)``. ASM: the PTX of
    :func:`_dequant_asm` (CUDA); else float32 maths rounded once (the interpreter), the same numbers."""
    A: tl.constexpr = byte.shape[0]
    NG: tl.constexpr = byte.shape[1]
    NB: tl.constexpr = byte.shape[2]
    PER: tl.constexpr = 8 // BITS
    if ASM:
        shape: tl.constexpr = (A, NG, NB)
        sb = tl.broadcast_to(s, shape)
        zb = tl.broadcast_to(z, shape)
        if BITS == 8:
            out = tl.inline_asm_elementwise(_ASM8, _CON8, [byte, sb, zb, tl.full(shape, 0x00FF00FF, tl.int32),
                                            tl.full(shape, 0x3C003C00, tl.int32), tl.full(shape, 0xE400E400 - (1 << 32), tl.int32)],
                                            dtype=tl.float16, is_pure=True, pack=4)
            out = tl.reshape(out, (A, NG * NB))
        elif BITS == 4:
            c0, c1 = tl.inline_asm_elementwise(
                _ASM4, _CON4, [byte, sb, zb,
                               tl.full(shape, 0x000F000F, tl.int32), tl.full(shape, 0x3C003C00, tl.int32), tl.full(shape, 0xE400E400 - (1 << 32), tl.int32),
                               tl.full(shape, 0x00F000F0, tl.int32), tl.full(shape, 0x2C002C00, tl.int32), tl.full(shape, 0xD400D400 - (1 << 32), tl.int32)],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            out = tl.reshape(tl.join(c0, c1), (A, NG * NB * 2))
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _ASM2, _CON2, [byte, sb, zb,
                               tl.full(shape, 0x00030003, tl.int32), tl.full(shape, 0x3C003C00, tl.int32), tl.full(shape, 0xE400E400 - (1 << 32), tl.int32),
                               tl.full(shape, 0x000C000C, tl.int32), tl.full(shape, 0x34003400, tl.int32), tl.full(shape, 0xDC00DC00 - (1 << 32), tl.int32),
                               tl.full(shape, 0x00300030, tl.int32), tl.full(shape, 0x2C002C00, tl.int32), tl.full(shape, 0xD400D400 - (1 << 32), tl.int32),
                               tl.full(shape, 0x00C000C0, tl.int32), tl.full(shape, 0x24002400, tl.int32), tl.full(shape, 0xCC00CC00 - (1 << 32), tl.int32)],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
            out = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (A, NG * NB * 4))
    else:
        x = byte.to(tl.int32)
        sf = s.to(tl.float32)
        zf = z.to(tl.float32)
        MASK: tl.constexpr = (1 << BITS) - 1
        if BITS == 8:
            out = tl.reshape((x.to(tl.float32) * sf + zf).to(tl.float16), (A, NG * NB))
        elif BITS == 4:
            c0 = ((x & MASK).to(tl.float32) * sf + zf).to(tl.float16)
            c1 = (((x >> 4) & MASK).to(tl.float32) * sf + zf).to(tl.float16)
            out = tl.reshape(tl.join(c0, c1), (A, NG * NB * 2))
        else:
            c0 = ((x & MASK).to(tl.float32) * sf + zf).to(tl.float16)
            c1 = (((x >> 2) & MASK).to(tl.float32) * sf + zf).to(tl.float16)
            c2 = (((x >> 4) & MASK).to(tl.float32) * sf + zf).to(tl.float16)
            c3 = (((x >> 6) & MASK).to(tl.float32) * sf + zf).to(tl.float16)
            out = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (A, NG * NB * 4))
    return out
_ASM8, _CON8 = (tl.constexpr(x) for x in _ASM[8])
_ASM4, _CON4 = (tl.constexpr(x) for x in _ASM[4])
_ASM2, _CON2 = (tl.constexpr(x) for x in _ASM[2])


@triton.jit
def _packed_key_tile(kc_ptr, ks_ptr, kz_ptr, bh, t0, c, kc_bh, kc_c, ks_bh, ks_c, ks_g,
                     BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr):
    """Keys of the all-quantised tokens t0 .. t0 + BT - 1 transposed, float16 ``[D, BT]``: the
    block's bytes as ``[D, groups in the block, bytes per group]`` with one scale and zero point
    per channel and group."""
    NGK: tl.constexpr = BT // GROUP if GROUP < BT else 1
    KB: tl.constexpr = (GROUP if GROUP < BT else BT) * BITS // 8
    g = tl.arange(0, NGK)
    j = tl.arange(0, KB)
    byte = tl.load(kc_ptr + bh * kc_bh + c[:, None, None] * kc_c + (t0 * BITS) // 8 + g[None, :, None] * KB + j[None, None, :])
    sp = ks_bh * bh + c[:, None] * ks_c + (t0 // GROUP + g[None, :]) * ks_g
    s = tl.load(ks_ptr + sp)[:, :, None]
    z = tl.load(kz_ptr + sp)[:, :, None]
    return _codes_f16(byte, s, z, BITS, ASM)


@triton.jit
def _packed_value_tile(vc_ptr, vs_ptr, vz_ptr, bh, t0, vc_bh, vc_t, vs_bh, vs_t,
                       BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr):
    """Values of the all-quantised tokens t0 .. t0 + BT - 1, float16 ``[BT, D]``: each token's
    bytes as ``[groups of channels, bytes per group]`` with one scale and zero point per group."""
    NGV: tl.constexpr = D // GROUP if GROUP < D else 1
    VB: tl.constexpr = (GROUP if GROUP < D else D) * BITS // 8
    t = t0 + tl.arange(0, BT)
    g = tl.arange(0, NGV)
    j = tl.arange(0, VB)
    byte = tl.load(vc_ptr + vc_bh * bh + t[:, None, None] * vc_t + g[None, :, None] * VB + j[None, None, :])
    sp = vs_bh * bh + t[:, None] * vs_t + g[None, :]
    s = tl.load(vs_ptr + sp)[:, :, None]
    z = tl.load(vz_ptr + sp)[:, :, None]
    return _codes_f16(byte, s, z, BITS, ASM)


@triton.jit
def _kivi_packed_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, rk_ptr, rv_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
    scale_log2, S, HKV, TQ, R, NBYTES,
    sq_b, sq_h, sq_t, kc_bh, kc_c, ks_bh, ks_c, ks_g, vc_bh, vc_t, vs_bh, vs_t, rk_bh, rk_t, rv_bh, rv_t,
    G: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, RP: tl.constexpr, BT: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, NGV: tl.constexpr, DOT_PREC: tl.constexpr, ASM: tl.constexpr,
):
    """:func:`_kivi_kernel` for float16 caches whose group and head_dim are powers of two, over the
    blocks of BT tokens whose keys and values are all codes (below min(Tk, Tv), split S ways):
    :func:`_packed_key_tile` / :func:`_packed_value_tile` (no masks, no gathers, no float32 per
    element). Partial at slot ``bh * (S + 1) + split``; slot S of each KV head is the tail's (the
    tokens from the last full block on, :func:`_kivi_kernel` with FROM_BT = BT), kept in a
    separate launch so that its generic tiles do not raise this kernel's register count."""
    pid_s = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pid_r = tl.program_id(2)
    b = bh // HKV
    kh = bh % HKV
    c = tl.arange(0, D)
    rows = pid_r * RB + tl.arange(0, RB)
    rmask = rows < R
    qh = kh * G + rows // TQ
    q = tl.load(q_ptr + b * sq_b + qh[:, None] * sq_h + (rows % TQ)[:, None] * sq_t + c[None, :], mask=rmask[:, None], other=0.0)
    tk = tl.load(len_ptr)
    tv = tl.load(len_ptr + 1)
    nk = tl.load(len_ptr + 2)
    full = tl.minimum(tk, tv) // BT  # blocks whose keys and values are all codes: the rest is the tail kernel's
    per = tl.cdiv(full, S)
    start = pid_s * per * BT
    end = tl.minimum(start + per * BT, full * BT)
    m_i = tl.full([RB], float("-inf"), tl.float32)
    l_i = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, D], tl.float32)
    every = tl.full([1, BT], 1, tl.int1)
    for t0 in range(start, end, BT):
        kt = _packed_key_tile(kc_ptr, ks_ptr, kz_ptr, bh, t0, c, kc_bh, kc_c, ks_bh, ks_c, ks_g, BT, D, BITS, GROUP, ASM)
        v = _packed_value_tile(vc_ptr, vs_ptr, vz_ptr, bh, t0, vc_bh, vc_t, vs_bh, vs_t, BT, D, BITS, GROUP, ASM)
        m_i, l_i, acc = attend_block(q, kt, v, every, m_i, l_i, acc, scale_log2, DOT_PREC, False)
    store_split_partial(acc_ptr, m_ptr, l_ptr, bh * (S + 1) + pid_s, rows, rmask, c, acc, m_i, l_i, RP, D)


def packed_path(q: torch.Tensor | None, cache: KiviCache) -> bool:
    """Whether :func:`_kivi_packed_kernel` serves this call (q None: a query in the cache dtype):
    float16 queries and cache, float16 scales, head_dim a power of two from 32, and a group that
    is a power of two whose codes fill whole 4-byte words (group x bits >= 32). Head_dim 16 takes
    the generic kernel: the packed one gave wrong outputs there on an H100 under Triton 3.6 (relative
    error 1.3-1.9 against the reference, every split count, while the interpreter agrees with it;
    head_dim 32 and up agree to 2e-4; 2026-11-28)."""
    _, _, d = cache.shape
    g = cache.group
    return ((q is None or q.dtype == torch.float16) and cache.dtype == torch.float16 and cache.key_scales.dtype == torch.float16
            and cache.value_scales.dtype == torch.float16 and d >= 32 and d & (d - 1) == 0 and g & (g - 1) == 0
            and min(g, d) * cache.bits >= 32)


def packed_block_tokens(cache: KiviCache) -> int:
    """Tokens per block of the packed kernel, the fastest of a sweep on an H100 (batch 8 x 32k,
    Llama-3-8B shape, docs/benchmarks.md): 64 for 2-bit codes, 128 for 4-bit codes in groups of
    128 or more, else 32."""
    if cache.bits == 2:
        return 64
    return 128 if cache.group >= 128 else 32


def plan_splits(cache: KiviCache, rows: int, device: torch.device, block: int | None = None, packed: bool = False) -> int:
    """Programs per (KV head, block of query rows) for ``rows`` query rows per KV head (G x Tq),
    1 on the interpreter. The generic kernel: about 4 programs per SM over the cache's capacity (at
    least 4 blocks of ``block`` tokens each, default its block). The packed kernel: about 16
    programs per SM (several waves, so that the last one is short) with at least 512 tokens each.
    Host arithmetic only."""
    b, hkv, _ = cache.shape
    rp = max(16, triton.next_power_of_2(rows))
    groups = b * hkv * (rp // min(rp, 64))
    bt = block or block_tokens(cache.group)[0]
    items = -(-cache.capacity // bt)
    if not packed or device.type != "cuda":
        return num_splits(groups, items, device, per_split_min=4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-16 * sms // groups), -(-items // max(4, 512 // bt))))


def workspace_bytes(cache: KiviCache, rows: int, device: torch.device) -> int:
    """Bytes one call with the default knobs allocates for ``rows`` query rows per KV head (a query
    in the cache dtype): the split partials (float32 accumulator, maximum and sum per padded row;
    one slot more for the packed kernel's tail; the CUDA backend's splits where it would serve) and
    the output and lse."""
    b, hkv, d = cache.shape
    rp = max(16, triton.next_power_of_2(rows))
    dp = max(16, triton.next_power_of_2(d))
    packed = packed_path(None, cache)
    if packed and device.type == "cuda" and _cuda_shape_problem(cache, rows) is None:  # the CUDA backend's splits
        slots = cuda_splits(cache, device) + 1
    else:
        slots = plan_splits(cache, rows, device, packed_block_tokens(cache) if packed else None, packed) + packed
    return 4 * b * hkv * slots * rp * (dp + 2) + 4 * b * hkv * rows * (d + 1)


def _cuda_extension():
    """The CUDA backend (:func:`kvtool.kernels.common.cuda_extension`: built on first use, cached)."""
    extra = tuple(os.environ.get("KVTOOL_KIVI_NVCC_FLAGS", "").split())  # tuning: e.g. -DKIVI_STAGES=2 -DKIVI_MINB=3
    return cuda_extension("kivi_decode", _CUDA_SOURCES, ("-O3", *extra))


def cuda_block_tokens(bits: int) -> int:
    """Tokens per block of the CUDA backend: 16 bytes of each key channel (128 / bits tokens)."""
    return 128 // bits


def cuda_path(q: torch.Tensor, cache: KiviCache) -> str | None:
    """None when the CUDA backend (kivi_decode.cuh) serves ``q`` over ``cache``, else why not:
    float16 CUDA tensors (not under TRITON_INTERPRET) on a GPU of compute capability 8.0 or later,
    the shapes of :func:`_cuda_shape_problem` and the layouts of :func:`_cuda_layout_problem`."""
    _, hkv, _ = cache.shape
    checks = (
        (q.is_cuda and not interpreting(), "CUDA tensors (not under TRITON_INTERPRET)"),
        (not q.is_cuda or torch.cuda.get_device_capability(q.device) >= (8, 0), "a GPU of compute capability 8.0 or later (cp.async, mma.m16n8k16)"),
        (packed_path(q, cache), "float16 queries, cache and scales"),
    )
    for ok, need in checks:
        if not ok:
            return f"the cuda backend needs {need}"
    problem = _cuda_shape_problem(cache, (q.shape[1] // hkv) * q.shape[2]) or _cuda_layout_problem(q, cache)
    return f"the cuda backend needs {problem}" if problem else None


def _cuda_layout_problem(q: torch.Tensor, cache: KiviCache) -> str | None:
    """What of the layouts the CUDA backend's copies need ``q`` and ``cache`` miss (None: all met):
    value-code and value-scale rows in whole 16-byte runs, key-code rows in 4-byte ones, group-major
    key scales, channels contiguous. Key tensors that hold no token (every key still in the
    residual) are never read, whatever their strides."""
    kc, ks, vc, vs = cache.key_codes, cache.key_scales, cache.value_codes, cache.value_scales
    no_keys = kc.shape[3] == 0 or ks.shape[3] == 0
    checks = (
        (q.stride(3) == 1 and all(x % 2 == 0 for x in q.stride()[:3]) and q.data_ptr() % 4 == 0, "a query with even strides"),
        (no_keys or (kc.stride(3) == 1 and kc.stride(2) % 4 == 0 and kc.stride(1) % 4 == 0 and kc.data_ptr() % 4 == 0), "key codes in 4-byte rows"),
        (vc.stride(3) == 1 and vc.stride(2) % 16 == 0 and vc.stride(1) % 16 == 0 and vc.data_ptr() % 16 == 0, "value codes in 16-byte rows"),
        (no_keys or (ks.stride(2) == 1 and ks.stride(3) % 2 == 0 and ks.stride(1) % 2 == 0 and ks.data_ptr() % 4 == 0
                     and cache.key_zeros.data_ptr() % 4 == 0), "group-major key scales"),
        (vs.stride(3) == 1 and vs.stride(2) == vs.shape[3] and cache.value_zeros.stride() == vs.stride(), "value scales in whole rows"),
    )
    for ok, need in checks:
        if not ok:
            return need
    return None


def _cuda_shape_problem(cache: KiviCache, rows: int) -> str | None:
    """What of the CUDA backend's shape needs ``cache`` with ``rows`` query rows per KV head
    misses (None: all met): head_dim 64 or 128, a power-of-two group of at least 16, at most 16
    rows, 1, 2, 4 or 8 value groups per token."""
    _, _, d = cache.shape
    g = cache.group
    gv = max(1, d // g)
    for ok, need in ((d in (64, 128), "head_dim 64 or 128"), (g >= 16 and g & (g - 1) == 0, "a power-of-two group of at least 16"),
                     (rows <= 16, "at most 16 query rows per KV head"),
                     (gv in (1, 2, 4, 8) and cache.value_scales.shape[3] == gv, "value groups 1, 2, 4 or 8 per token")):
        if not ok:
            return need
    return None


def cuda_splits(cache: KiviCache, device: torch.device) -> int:
    """Splits of the CUDA backend (one per warp, a multiple of its warps per block): 512 tokens of
    the tensors' capacity each, at most four waves of resident warps (12 per SM) over the B x Hkv
    heads (an H200 sweep at batch 1 and 8 x 32k, 2 and 4 bits: 512 tokens a warp within 3% of the
    best at batch 8, the best at batch 1, where more splits lose to the merge). Host arithmetic only."""
    b, hkv, _ = cache.shape
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = min(-(-cache.capacity // 512), -(-4 * 12 * sms // (b * hkv)))
    return max(CUDA_WARPS, -(-want // CUDA_WARPS) * CUDA_WARPS)


def kivi_attention(q: torch.Tensor, cache: KiviCache, scale: float | None = None, splits: int | None = None,
                   num_warps: int | None = None, *, block: int | None = None, num_stages: int | None = None,
                   packed: bool | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Partial (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32) of q over every token the
    cache holds (module docstring). Float16 caches of power-of-two groups and head_dim go through
    the packed-codes kernel (:func:`packed_path`), others through the generic one. Tuning knobs:
    ``splits`` programs per KV head and row block (default :func:`plan_splits`); ``num_warps``
    (default 4 on the packed kernel, else 8 from head_dim 128); ``block`` tokens per block of the
    packed kernel (default :func:`packed_block_tokens`; a power of two from 32: blocks of 16 gave wrong
    sums on an H100 under Triton 3.6; 16 query rows a program, as 64 failed Triton 3.6's dot-operand
    pass); ``num_stages``
    (Triton's software pipelining, default Triton's); ``packed`` False forces the generic kernel.
    ``backend``: ``auto`` takes the CUDA kernel (:func:`cuda_path`: codes dequantised in the MMA
    fragments, kivi_decode.cuh) where it serves the call and the Triton knobs are left alone, else
    Triton; ``cuda`` or ``triton`` force one (``splits`` then counts warps, rounded up to a multiple
    of 4). No host syncs: capturable in a CUDA graph."""
    check_cache(q, cache)
    b, hkv, d = cache.shape
    h, tq = q.shape[1], q.shape[2]
    g = h // hkv
    rows = g * tq
    device = q.device
    out = torch.empty(b, h, tq, d, dtype=torch.float32, device=device)
    lse = torch.empty(b, h, tq, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out, lse
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    why = cuda_path(q, cache) if backend != "triton" else "triton was asked for"
    if backend == "cuda" and why:
        raise UsageError(why)
    tuned = packed is False or block is not None or num_stages is not None or num_warps is not None
    if backend == "cuda" or (backend == "auto" and why is None and not tuned and _toolchain_ok()):
        try:
            return _cuda_attention(q, cache, scale, splits, out, lse)
        except BadDataError as exc:  # the extension did not build here: auto goes on with Triton, once said
            if backend == "cuda":
                raise
            _TOOLCHAIN[:] = [False]
            note(f"kvtool: the CUDA KIVI kernel is unavailable ({exc}); using the Triton kernel")
    use_packed = packed_path(q, cache) if packed is None else (packed and packed_path(q, cache))
    if packed and not use_packed:
        raise UsageError("packed=True needs float16 queries, cache and scales, a power-of-two head_dim and group, and group x bits >= 32")
    rp = max(16, triton.next_power_of_2(rows))
    rb = min(rp, 64)
    dp = max(16, triton.next_power_of_2(d))
    if use_packed:
        bt = int(block or packed_block_tokens(cache))
        if bt < 32 or bt & (bt - 1):
            raise UsageError(f"block must be a power of two from 32, got {block}")
        rb = 16  # 64 rows trip Triton 3.6's dot-operand pass (illegal shared layout) at blocks of 32 and 64 tokens (H100)
        block_scales = True
    else:
        bt, block_scales = block_tokens(cache.group)
    s = max(1, int(splits)) if splits is not None else plan_splits(cache, rows, device, bt, use_packed)
    slots = s + 1 if use_packed else s  # the packed kernel's tail goes in one more slot
    acc, m, l = _partials(b * hkv, slots, rp, dp, device)
    scale = default_scale(d) if scale is None else scale
    prec, upcast = dot_flags(q.dtype, device)
    ngv = -(-d // cache.group)
    args = lambda s: _kernel_args(q, cache, acc, m, l, scale, s)  # noqa: E731
    tune = {} if num_stages is None else {"num_stages": int(num_stages)}
    generic = dict(G=g, D=d, DP=dp, RB=rb, RP=rp, BITS=cache.bits, GROUP=cache.group, NGV=ngv, DOT_PREC=prec, UPCAST=upcast)
    if use_packed:
        _kivi_packed_kernel[(s, b * hkv, rp // rb)](
            *args(s), G=g, D=d, RB=rb, RP=rp, BT=bt, BITS=cache.bits, GROUP=cache.group, NGV=ngv, DOT_PREC=prec,
            ASM=device.type == "cuda", num_warps=num_warps or 4, num_stages=int(num_stages or 3),
        )
        tail_bt, tail_scales = block_tokens(cache.group)
        _kivi_kernel[(1, b * hkv, rp // rb)](
            *args(1), BT=tail_bt, BLOCK_SCALES=tail_scales and bt % tail_bt == 0, FROM_BT=bt, SLOTS=slots,
            num_warps=8 if dp * tail_bt >= 8192 else 4, **generic,
        )
    else:
        _kivi_kernel[(s, b * hkv, rp // rb)](
            *args(s), BT=bt, BLOCK_SCALES=block_scales, num_warps=num_warps or (8 if dp * bt >= 8192 else 4), **tune, **generic,
        )
    merge_split_partials(acc, m, l, out.view(-1, d), lse.view(-1), rows)
    return out, lse


def _partials(groups: int, slots: int, rp: int, dp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised split partials (every slot is written by its kernel): acc ``[groups, slots, rp,
    dp]``, m and l ``[groups, slots, rp]``, float32, the layout :func:`merge_split_partials` reads."""
    acc = torch.empty(groups, slots, rp, dp, dtype=torch.float32, device=device)
    m = torch.empty(groups, slots, rp, dtype=torch.float32, device=device)
    l = torch.empty(groups, slots, rp, dtype=torch.float32, device=device)
    return acc, m, l


def _kernel_args(q: torch.Tensor, cache: KiviCache, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, scale: float,
                 splits: int) -> tuple:
    """The positional arguments of :func:`_kivi_kernel` and :func:`_kivi_packed_kernel` (tensors,
    scale, split count, shapes and strides) for ``q`` over ``cache`` into the partials."""
    _, hkv, _ = cache.shape
    h, tq = q.shape[1], q.shape[2]
    kc, ks, kz, vc, vs, vz, rk, rv = cache.tensors()
    return (q, kc, ks, kz, vc, vs, vz, rk, rv, cache.lengths, acc, m, l,
            float(scale) * LOG2E, splits, hkv, tq, (h // hkv) * tq, vc.shape[3],
            q.stride(0), q.stride(1), q.stride(2), kc.stride(1), kc.stride(2), ks.stride(1), ks.stride(2), ks.stride(3),
            vc.stride(1), vc.stride(2), vs.stride(1), vs.stride(2), rk.stride(1), rk.stride(2), rv.stride(1), rv.stride(2))


_TOOLCHAIN: list[bool] = []


def _toolchain_ok() -> bool:
    """Whether this process can build CUDA extensions (asked once)."""
    if not _TOOLCHAIN:
        from kvtool.kernels.extensions import toolchain_problem  # deferred: it imports the build machinery

        _TOOLCHAIN.append(toolchain_problem() is None)
    return _TOOLCHAIN[0]


def _cuda_attention(q: torch.Tensor, cache: KiviCache, scale: float | None, splits: int | None, out: torch.Tensor,
                    lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA backend: kivi_decode.cuh over the blocks of all-code tokens (one split per warp),
    the tail by the generic Triton kernel into one more slot, then the shared merge."""
    b, hkv, d = cache.shape
    h, tq = q.shape[1], q.shape[2]
    g = h // hkv
    rows = g * tq
    device = q.device
    s = cuda_splits(cache, device) if splits is None else max(CUDA_WARPS, -(-int(splits) // CUDA_WARPS) * CUDA_WARPS)
    slots = s + 1
    rp, dp = 16, d
    acc, m, l = _partials(b * hkv, slots, rp, dp, device)
    scale = default_scale(d) if scale is None else scale
    kc, ks, kz, vc, vs, vz, _, _ = cache.tensors()
    _cuda_extension().kivi_decode(q, kc, ks, kz, vc, vs, vz, cache.lengths, acc, m, l, hkv, cache.bits, cache.group, s,
                                  float(scale) * LOG2E, torch.cuda.current_stream(device).cuda_stream, CUDA_KERNELS[cuda_kernel()])
    prec, upcast = dot_flags(q.dtype, device)
    tail_bt, tail_scales = block_tokens(cache.group)
    bt = cuda_block_tokens(cache.bits)
    _kivi_kernel[(1, b * hkv, 1)](
        *_kernel_args(q, cache, acc, m, l, scale, 1),
        G=g, D=d, DP=dp, RB=rp, RP=rp, BT=tail_bt, BITS=cache.bits, GROUP=cache.group, BLOCK_SCALES=tail_scales and bt % tail_bt == 0,
        NGV=-(-d // cache.group), DOT_PREC=prec, UPCAST=upcast, FROM_BT=bt, SLOTS=slots, num_warps=8 if dp * tail_bt >= 8192 else 4,
    )
    merge_split_partials(acc, m, l, out.view(-1, d), lse.view(-1), rows)
    return out, lse


# ----------------------------------------------------------------------------- torch reference


def _unpack_torch(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 ``[..., m]`` packed codes -> int64 ``[..., n]`` (the order of ``pack_codes``)."""
    if bits == 8:
        return packed[..., :n].long()
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device) * bits
    codes = (packed.long()[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :n]


def dequantize(cache: KiviCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys / values ``[B, Hkv, T, D]`` in the cache dtype of the tokens in use (lengths read on the
    host): ``code * scale + zero`` in float32 rounded to the cache dtype, then the residual tokens."""
    tk, tv, nk, nv = (int(x) for x in cache.lengths.tolist())
    b, h, d = cache.shape
    g = cache.group
    kcodes = _unpack_torch(cache.key_codes, cache.bits, tk).float()  # [B, Hkv, D, Tk]
    kidx = torch.arange(tk, device=kcodes.device) // g
    ks, kz = cache.key_scales.float()[..., kidx], cache.key_zeros.float()[..., kidx]
    kq = (kcodes * ks + kz).to(cache.dtype).transpose(-1, -2)
    vcodes = _unpack_torch(cache.value_codes[:, :, :tv], cache.bits, d).float()  # [B, Hkv, Tv, D]
    vidx = torch.arange(d, device=vcodes.device) // g
    vs, vz = cache.value_scales[:, :, :tv].float()[..., vidx], cache.value_zeros[:, :, :tv].float()[..., vidx]
    vq = (vcodes * vs + vz).to(cache.dtype)
    keys = torch.cat([kq, cache.residual_keys[:, :, :nk]], dim=2)
    values = torch.cat([vq, cache.residual_values[:, :, :nv]], dim=2)
    return keys, values


def kivi_attention_reference(q: torch.Tensor, cache: KiviCache, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The maths of :func:`kivi_attention` in torch: :func:`dequantize`, then float32 attention."""
    keys, values = dequantize(cache)
    return attend_partial(q, keys, values, scale)

