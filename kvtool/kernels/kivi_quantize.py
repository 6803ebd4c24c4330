"""One launch that moves a group of a live KIVI cache's residual tokens into its quantised store.

A live KIVI layer (:class:`kvtool.formats.quant.QuantLive`) keeps its newest tokens in full
precision and, once a residual holds R + g tokens, quantises its oldest ``g`` into the packed codes
(keys per channel over tokens, values per token over groups of channels) and moves the rest down.
In torch that is 68 aten ops (launches on CUDA) and two host syncs per kind and layer; here one launch
(:func:`absorb_keys`, :func:`absorb_values`) that, for every (batch, KV head) program:

1. loads the ``g`` oldest residual tokens ``[g, D]``, quantises them with the maths of
   :func:`kvtool.methods.quantize.quantize_groups` (the torch reference, bit for bit: min/max in
   float32, zero point rounded *down* and scale rounded *up* to the scale dtype, IEEE division,
   round half to even, clamp, codes 0 where the scale is 0) and writes packed codes, scales and zero
   points at token ``pos`` of the cache tensors (any strides for scales and zero points);
2. moves the residual's tokens ``g .. count-1`` down to ``0 .. count-g-1`` in chunks of ``g`` tokens
   (a CTA barrier between each chunk's load and store: source and destination overlap);
3. writes, for each of the first ``flag_groups`` whole groups of the moved residual, whether it
   holds a value with ``|x| >= range_limit`` (bit 0) or a NaN (bit 1), so that the host can decide
   the next absorb's scale dtype from the lengths read it does anyway (one host sync);
4. program 0 writes the new lengths (quantised tokens ``pos + g``, residual tokens ``count - g``).

``status`` is int32 ``[4 + 2 * flag_groups * B * Hkv]`` on the device: the cache's ``lengths`` (Tk,
Tv, nk, nv) then the flags, keys' first (``[flag_groups, B * Hkv]``), then values'.

Layouts (B batch, H = Hkv KV heads, S residual slots, D head_dim, dt float16 / bfloat16 / float32,
sdt the scale dtype float16 / bfloat16 / float32, per = 8 // bits):

- residual ``[B, H, S, D]`` dt, contiguous in D;
- keys: ``key_codes`` uint8 ``[B, H, D, >= (pos + g) * bits / 8]`` (token ``j`` of a channel in bits
  ``(j % per) * bits`` of byte ``j // per``), ``key_scales`` / ``key_zeros`` sdt ``[B, H, D, >=
  pos / g + 1]``;
- values: ``value_codes`` uint8 ``[B, H, >= pos + g, ceil(D * bits / 8)]`` (packed along D),
  ``value_scales`` / ``value_zeros`` sdt ``[B, H, >= pos + g, ceil(D / g)]`` (groups of ``g``
  channels, the last shorter when ``g`` does not divide D; one group of D when ``g >= D``).

Exactness notes: ``/`` on float32 in Triton lowers to an approximate division on NVIDIA GPUs, so
every division is :func:`triton.language.math.div_rn`; rounding is half to even (as
``torch.round``) by adding and subtracting 2**23 (:func:`_rint`: libdevice's ``rint`` has no CPU
interpreter twin); a directed rounding to a 16-bit scale dtype is a round-to-nearest
conversion followed, when it went the wrong way, by one step of the 16-bit pattern (the
``torch.nextafter`` of :func:`kvtool.methods.quantize.round_to_dtype`, signed zeros included). Codes
of NaN inputs are not defined by the reference and are not compared.

Every integer argument is left unspecialised (``do_not_specialize``): Triton otherwise compiles a
kernel again for each new divisibility by 16 of a position, a count or a stride, and a growing
cache changes all of them (a re-allocated capacity changes the strides). A compile costs seconds:
an H100 diagnostic (d9e5b62, Triton's compile listener) timed each kernel's first compile at about
1.5 s inside a 9 ms absorb, so with every integer unspecialised each kernel compiles once per
process and set of constexprs.

Kernels sit below the formats: tensors and ints in, nothing from :mod:`kvtool.formats` or
:mod:`kvtool.methods` (the range limit, FP16_SAFE there, is an argument).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvtool.core.errors import UsageError
from kvtool.kernels.common import KERNEL_DTYPES, check_device, interpreting

BITS = (2, 4, 8)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK = 1 << 15  # elements of one program's [g, D] block (padded to powers of two); larger groups take torch
KEYS, VALUES = 0, 1  # index of a kind in ``lengths`` (quantised tokens; residual tokens at + 2)


def status_size(batch: int, heads: int, flag_groups: int) -> int:
    """Entries of the int32 ``status`` buffer: the 4 lengths and both kinds' range flags."""
    return 4 + 2 * flag_groups * batch * heads


def flag_offset(kind: int, batch: int, heads: int, flag_groups: int) -> int:
    """Where ``kind``'s range flags ``[flag_groups, B * H]`` start in ``status``."""
    return 4 + kind * flag_groups * batch * heads


def supported(dtype: torch.dtype, scale_dtype: torch.dtype, bits: int, group: int, head_dim: int) -> bool:
    """Whether the kernel serves a cache of ``dtype`` with ``scale_dtype`` scales, ``bits``-bit codes
    in groups of ``group`` (whole bytes of key codes per group) and head dimension ``head_dim``;
    else the caller keeps its torch path."""
    block = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim)
    return (dtype in KERNEL_DTYPES and scale_dtype in SCALE_DTYPES and bits in BITS and group >= 1
            and group * bits % 8 == 0 and block <= MAX_BLOCK)


@triton.jit
def _round_to(x, out_ty: tl.constexpr, UP: tl.constexpr, WIDE: tl.constexpr):
    """float32 ``x`` in ``out_ty``, rounded up (result >= x) or down (result <= x): float32 is
    exact (``WIDE``); a 16-bit type rounds to nearest, then steps one pattern outward when that
    went the wrong way (positive: +-1 on the bits, negative: the other way, zero: the smallest
    subnormal of the direction's sign), as ``torch.nextafter`` does. (One return: the compiler
    generates what follows a return inside a constexpr branch, so the 16-bit path is an else.)"""
    if WIDE:
        out = x
    else:
        y = x.to(out_ty)
        yf = y.to(tl.float32)
        bits = y.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        negative = bits >= 0x8000
        is_zero = (bits & 0x7FFF) == 0
        if UP:
            wrong = yf < x
            nxt = tl.where(is_zero, 0x0001, tl.where(negative, bits - 1, bits + 1))
        else:
            wrong = yf > x
            nxt = tl.where(is_zero, 0x8001, tl.where(negative, bits + 1, bits - 1))
        stepped = nxt.to(tl.int16).to(out_ty, bitcast=True)
        out = tl.where(wrong, stepped, y)
    return out


@triton.jit
def _extreme(x, inside, order, A: tl.constexpr, B: tl.constexpr, HIGH: tl.constexpr):
    """The minimum (maximum when ``HIGH``) of float32 ``x`` where ``inside``, reduced along axis
    ``A`` then ``B``; a zero result carries the sign of the first zero in ``order`` (torch's CPU
    ``amin`` / ``amax`` keep the first of equal elements, and -0.0 == 0.0: the signs of the stored
    zero point and of a zero scale follow)."""
    if HIGH:
        m = tl.max(tl.max(tl.where(inside, x, float("-inf")), axis=A), axis=B)
    else:
        m = tl.min(tl.min(tl.where(inside, x, float("inf")), axis=A), axis=B)
    at_zero = inside & (x == 0.0)
    first = tl.min(tl.min(tl.where(at_zero, order, 1 << 30), axis=A), axis=B)
    is_first = at_zero & (order == tl.expand_dims(tl.expand_dims(first, B), A))
    negative = tl.max(tl.max(tl.where(is_first & (x.to(tl.int32, bitcast=True) < 0), 1, 0), axis=A), axis=B)
    signed_zero = tl.where(negative > 0, -2147483648, 0).to(tl.int32)
    return tl.where(m == 0.0, signed_zero, m.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _scale_and_zero(lo, hi, out_ty: tl.constexpr, LEVELS: tl.constexpr, WIDE: tl.constexpr):
    """A group's stored zero point (``lo`` rounded down) and scale (``(hi - zero) / levels``
    rounded up), in ``out_ty``, from float32 min / max."""
    zero = _round_to(lo, out_ty, False, WIDE)
    span = hi - zero.to(tl.float32)
    scale = _round_to(tl.math.div_rn(span, tl.full(span.shape, LEVELS, tl.float32)), out_ty, True, WIDE)
    return scale, zero


@triton.jit
def _rint(y, LIBDEVICE: tl.constexpr):
    """float32 ``y`` rounded to an integer, half to even (``torch.round``): libdevice's ``rint``
    on a GPU (``LIBDEVICE``); under the CPU interpreter, which lacks it, adding and subtracting
    2**23 below 2**23 in magnitude (IEEE round to nearest even; larger magnitudes are integers)."""
    if LIBDEVICE:
        out = libdevice.rint(y)
    else:
        a = tl.abs(y)
        r = (a + 8388608.0) - 8388608.0
        r = tl.where(y < 0, -r, r)
        out = tl.where(a >= 8388608.0, y, r)
    return out


@triton.jit
def _codes(x, scale, zero, LEVELS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """int32 codes ``clamp(rint((x - zero) / scale), 0, levels)``, 0 where the scale is 0 (float32
    ``scale`` / ``zero`` broadcast against ``x``)."""
    safe = tl.where(scale > 0, scale, 1.0)
    q = _rint(tl.math.div_rn(x - zero, safe), LIBDEVICE)
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS)
    return tl.where(scale > 0, q, 0.0).to(tl.int32)


@triton.jit
def _move_down_and_flag(res, count, status_ptr, flag_base, bh, BH, range_limit, r_t,
                        G: tl.constexpr, D: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr, FLAG_GROUPS: tl.constexpr):
    """Residual tokens ``G .. count-1`` of one (batch, head) moved to ``0 .. count-G-1``, a chunk
    of G tokens at a time (each element loaded and stored by one thread, a barrier in between, so
    that no store overtakes a load of the same slot); the range flags of the first chunks."""
    t = tl.arange(0, G_P)[:, None]
    d = tl.arange(0, D_P)[None, :]
    rest = count - G
    for i in range(0, tl.cdiv(rest, G)):
        dst = i * G + t
        m = (t < G) & (dst < rest) & (d < D)
        v = tl.load(res + (dst + G) * r_t + d, mask=m, other=0.0)
        tl.debug_barrier()
        tl.store(res + dst * r_t + d, v, mask=m)
        if i < FLAG_GROUPS:
            vf = v.to(tl.float32)
            big = tl.max(tl.max(tl.where(m & (tl.abs(vf) >= range_limit), 1, 0), axis=1), axis=0)
            nan = tl.max(tl.max(tl.where(m & (vf != vf), 2, 0), axis=1), axis=0)
            tl.store(status_ptr + flag_base + i * BH + bh, big | nan)


@triton.jit
def _store_lengths(status_ptr, bh, quantised, residual, KIND: tl.constexpr):
    """Program 0 writes the kind's new lengths (quantised tokens, residual tokens)."""
    if bh == 0:
        tl.store(status_ptr + KIND, quantised)
        tl.store(status_ptr + KIND + 2, residual)


@triton.jit(do_not_specialize=["H", "count", "pos_byte", "pos_group", "quantised", "flag_base", "r_b", "r_h", "r_t", "c_b", "c_h", "c_d",
                               "s_b", "s_h", "s_d", "s_g", "z_b", "z_h", "z_d", "z_g"])
def _absorb_keys_kernel(res_ptr, codes_ptr, scales_ptr, zeros_ptr, status_ptr,
                        H, count, pos_byte, pos_group, quantised, flag_base, range_limit,
                        r_b, r_h, r_t, c_b, c_h, c_d, s_b, s_h, s_d, s_g, z_b, z_h, z_d, z_g,
                        G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, WIDE: tl.constexpr, FLAG_GROUPS: tl.constexpr,
                        LIBDEVICE: tl.constexpr, NB_P: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr):
    """One program per (batch, head): keys per channel over G tokens (module docstring)."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    res = res_ptr + b * r_b + h * r_h
    nb = tl.arange(0, NB_P)[:, None, None]
    k = tl.arange(0, PER)[None, :, None]
    d = tl.arange(0, D_P)[None, None, :]
    tok = nb * PER + k
    valid = (tok < G) & (d < D)
    x = tl.load(res + tok * r_t + d, mask=valid, other=0.0).to(tl.float32)
    lo = _extreme(x, valid, tok, 1, 0, False)  # [D_P]
    hi = _extreme(x, valid, tok, 1, 0, True)
    scale, zero = _scale_and_zero(lo, hi, scales_ptr.dtype.element_ty, LEVELS, WIDE)
    q = _codes(x, scale.to(tl.float32)[None, None, :], zero.to(tl.float32)[None, None, :], LEVELS, LIBDEVICE)
    q = tl.where(valid, q, 0)
    packed = tl.sum(q << (k * BITS), axis=1)  # [NB_P, D_P]: byte nb of each channel
    dc = tl.arange(0, D_P)
    nb2 = tl.arange(0, NB_P)[:, None]
    tl.store(codes_ptr + b * c_b + h * c_h + dc[None, :] * c_d + pos_byte + nb2, packed.to(tl.uint8),
             mask=(nb2 < G // PER) & (dc[None, :] < D))
    tl.store(scales_ptr + b * s_b + h * s_h + dc * s_d + pos_group * s_g, scale, mask=dc < D)
    tl.store(zeros_ptr + b * z_b + h * z_h + dc * z_d + pos_group * z_g, zero, mask=dc < D)
    _move_down_and_flag(res, count, status_ptr, flag_base, bh, tl.num_programs(0), range_limit, r_t, G, D, G_P, D_P, FLAG_GROUPS)
    _store_lengths(status_ptr, bh, quantised, count - G, 0)


@triton.jit(do_not_specialize=["H", "count", "pos", "quantised", "flag_base", "r_b", "r_h", "r_t", "c_b", "c_h", "c_t",
                               "s_b", "s_h", "s_t", "s_g", "z_b", "z_h", "z_t", "z_g"])
def _absorb_values_kernel(res_ptr, codes_ptr, scales_ptr, zeros_ptr, status_ptr,
                          H, count, pos, quantised, flag_base, range_limit,
                          r_b, r_h, r_t, c_b, c_h, c_t, s_b, s_h, s_t, s_g, z_b, z_h, z_t, z_g,
                          G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, WIDE: tl.constexpr, FLAG_GROUPS: tl.constexpr,
                          LIBDEVICE: tl.constexpr, NGV: tl.constexpr, NBD_P: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr):
    """One program per (batch, head): values per token in NGV groups of G channels (module docstring)."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    out_ty: tl.constexpr = scales_ptr.dtype.element_ty
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    res = res_ptr + b * r_b + h * r_h
    t = tl.arange(0, G_P)[:, None, None]
    k = tl.arange(0, PER)[None, None, :]
    ch = tl.arange(0, NBD_P)[None, :, None] * PER + k  # channel of each element
    valid = (t < G) & (ch < D)
    x = tl.load(res + t * r_t + ch, mask=valid, other=0.0).to(tl.float32)
    group_of = ch // G
    scale_el = tl.zeros([G_P, NBD_P, PER], tl.float32)
    zero_el = tl.zeros([G_P, NBD_P, PER], tl.float32)
    t1 = tl.arange(0, G_P)
    srow = scales_ptr + b * s_b + h * s_h + (pos + t1) * s_t
    zrow = zeros_ptr + b * z_b + h * z_h + (pos + t1) * z_t
    for j in range(NGV):
        inj = valid & (group_of == j)
        lo = _extreme(x, inj, ch, 2, 1, False)  # [G_P]
        hi = _extreme(x, inj, ch, 2, 1, True)
        scale, zero = _scale_and_zero(lo, hi, out_ty, LEVELS, WIDE)
        tl.store(srow + j * s_g, scale, mask=t1 < G)
        tl.store(zrow + j * z_g, zero, mask=t1 < G)
        scale_el = tl.where(group_of == j, scale.to(tl.float32)[:, None, None], scale_el)
        zero_el = tl.where(group_of == j, zero.to(tl.float32)[:, None, None], zero_el)
    q = tl.where(valid, _codes(x, scale_el, zero_el, LEVELS, LIBDEVICE), 0)
    packed = tl.sum(q << (k * BITS), axis=2)  # [G_P, NBD_P]: byte of each token
    t2 = tl.arange(0, G_P)[:, None]
    nb = tl.arange(0, NBD_P)[None, :]
    tl.store(codes_ptr + b * c_b + h * c_h + (pos + t2) * c_t + nb, packed.to(tl.uint8),
             mask=(t2 < G) & (nb < (D + PER - 1) // PER))
    _move_down_and_flag(res, count, status_ptr, flag_base, bh, tl.num_programs(0), range_limit, r_t, G, D, G_P, D_P, FLAG_GROUPS)
    _store_lengths(status_ptr, bh, quantised, count - G, 1)


def _check(residual: torch.Tensor, count: int, status: torch.Tensor, flag_groups: int, bits: int, group: int, scales: torch.Tensor, **tensors: torch.Tensor) -> None:
    check_device(residual=residual, status=status, scales=scales, **tensors)
    b, h, slots, d = residual.shape
    if not supported(residual.dtype, scales.dtype, bits, group, d):
        raise UsageError(f"the KIVI absorb kernel does not serve {residual.dtype} tokens with {scales.dtype} scales, {bits} bits, group {group}, head_dim {d}")
    if not group <= count <= slots:
        raise UsageError(f"a residual of {count} tokens in {slots} slots cannot give a group of {group}")
    if residual.stride(3) != 1 or status.dtype != torch.int32 or status.numel() < status_size(b, h, flag_groups) or not status.is_contiguous():
        raise UsageError("the residual must be contiguous in head_dim and status a contiguous int32 buffer of the lengths and flags")


def _warps(group: int, head_dim: int) -> int:
    return 8 if triton.next_power_of_2(group) * triton.next_power_of_2(head_dim) >= 8192 else 4


def absorb_keys(residual: torch.Tensor, count: int, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                status: torch.Tensor, pos: int, bits: int, group: int, range_limit: float, flag_groups: int) -> None:
    """Quantise the oldest ``group`` of ``count`` residual keys ``[B, H, S, D]`` per channel into
    ``codes`` / ``scales`` / ``zeros`` at token ``pos`` (a multiple of ``group``), move the rest
    down, write lengths 0 and 2 of ``status`` (``pos + group``, ``count - group``) and the keys'
    range flags of the moved residual's first ``flag_groups`` groups (module docstring). One launch."""
    _check(residual, count, status, flag_groups, bits, group, scales, codes=codes, zeros=zeros)
    b, h, _, d = residual.shape
    per = 8 // bits
    _absorb_keys_kernel[(b * h,)](
        residual, codes, scales, zeros, status, h, count, pos * bits // 8, pos // group, pos + group,
        flag_offset(KEYS, b, h, flag_groups), float(range_limit),
        residual.stride(0), residual.stride(1), residual.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
        *scales.stride(), *zeros.stride(),
        G=group, D=d, BITS=bits, WIDE=scales.dtype == torch.float32, FLAG_GROUPS=flag_groups, LIBDEVICE=not interpreting(),
        NB_P=triton.next_power_of_2(group // per), G_P=triton.next_power_of_2(group), D_P=triton.next_power_of_2(d),
        num_warps=_warps(group, d), num_stages=1)


def absorb_values(residual: torch.Tensor, count: int, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  status: torch.Tensor, pos: int, bits: int, group: int, range_limit: float, flag_groups: int) -> None:
    """Quantise the oldest ``group`` of ``count`` residual values ``[B, H, S, D]`` per token (groups
    of ``group`` channels) into ``codes`` / ``scales`` / ``zeros`` at tokens ``pos ..``, move the
    rest down, write lengths 1 and 3 of ``status`` (``pos + group``, ``count - group``) and the
    values' range flags (module docstring). One launch."""
    _check(residual, count, status, flag_groups, bits, group, scales, codes=codes, zeros=zeros)
    b, h, _, d = residual.shape
    per = 8 // bits
    if codes.stride(3) != 1:
        raise UsageError("value codes must be contiguous in their packed bytes")
    _absorb_values_kernel[(b * h,)](
        residual, codes, scales, zeros, status, h, count, pos, pos + group,
        flag_offset(VALUES, b, h, flag_groups), float(range_limit),
        residual.stride(0), residual.stride(1), residual.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
        *scales.stride(), *zeros.stride(),
        G=group, D=d, BITS=bits, WIDE=scales.dtype == torch.float32, FLAG_GROUPS=flag_groups, LIBDEVICE=not interpreting(),
        NGV=-(-d // group), NBD_P=triton.next_power_of_2(-(-d // per)), G_P=triton.next_power_of_2(group), D_P=triton.next_power_of_2(d),
        num_warps=_warps(group, d), num_stages=1)
