"""Bitmap compression: a pruned dense tensor -> the bitmap layout of :mod:`.bitmap_layout`.

Two encoders that produce identical bytes:

- :func:`encode_torch` (plain torch, any device);
- :func:`encode_triton` (Triton, two passes over the data, each loading a block as coalesced
  ``[64 tokens, D]`` rows): pass 1 writes each block's bitmaps (keys: per-channel words by masked
  reductions over the token axis) and its count; the host turns the padded counts into offsets with
  one cumsum and sizes ``nz`` (one sync); pass 2 places every stored element from the bitmap words
  pass 1 wrote (the words' popcount prefix + the popcount of the bits below it) and writes them
  with one 1-D store in storage order, so that a warp's lanes write neighbouring elements.
  CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. Timings: docs/benchmarks.md.

Input ``x``: ``[B, Hkv, Tc, D]`` float16 / bfloat16 / float32, the pruned keys or values (pruned
elements +0.0). An element is stored when its bit pattern is not all zero. :func:`encode_cache`
builds a whole :class:`~.bitmap_layout.BitmapCache` (keys, values, dense window) and is the quick
way to make kernel inputs of any size on the GPU.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from kvtool.core.errors import UsageError
from kvtool.kernels.common import check_device, interpreting
from kvtool.kernels.bitmap_layout import (
    _INT_VIEW,
    TILE,
    BitmapCache,
    BitmapTensor,
    align_elements,
    bits_to_words,
    nonzero_bits,
)


def check_input(x: torch.Tensor, kind: str) -> None:
    """``x`` is a 4-D float16 / bfloat16 / float32 ``[B, Hkv, Tc, D]`` and ``kind`` a tile orientation."""
    if kind not in ("keys", "values"):
        raise UsageError(f"kind must be 'keys' or 'values', got {kind!r}")
    if x.ndim != 4:
        raise UsageError(f"{kind} must be [batch, kv_heads, tokens, head_dim], got shape {list(x.shape)}")
    if x.dtype not in _INT_VIEW:
        raise UsageError(f"{kind} must be float16, bfloat16 or float32, got {x.dtype}")


def _offsets(counts: torch.Tensor, align: int) -> torch.Tensor:
    padded = (counts + align - 1) // align * align
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)])


def encode_torch(x: torch.Tensor, kind: str) -> BitmapTensor:
    """Plain-torch encoder: ``x`` ``[B, Hkv, Tc, D]`` -> :class:`BitmapTensor` (see module doc)."""
    check_input(x, kind)
    b, h, tc, d = x.shape
    nb = -(-tc // TILE)
    dt = -(-d // TILE)
    bits = nonzero_bits(x)
    data = x
    if kind == "keys":
        pad = nb * TILE - tc
        bits = torch.cat([bits, bits.new_zeros(b, h, pad, d)], 2) if pad else bits
        data = torch.cat([data, data.new_zeros(b, h, pad, d)], 2) if pad else data
        bits = bits.reshape(b, h, nb, TILE, d).transpose(-1, -2)  # [B, Hkv, NB, D, 64]
        data = data.reshape(b, h, nb, TILE, d).transpose(-1, -2)
        bitmaps = bits_to_words(bits)
    else:
        cpad = dt * TILE - d
        bits = torch.cat([bits, bits.new_zeros(b, h, tc, cpad)], 3) if cpad else bits
        data = torch.cat([data, data.new_zeros(b, h, tc, cpad)], 3) if cpad else data
        bitmaps = bits_to_words(bits.reshape(b, h, tc, dt, TILE))
        pad = nb * TILE - tc
        bits = torch.cat([bits, bits.new_zeros(b, h, pad, dt * TILE)], 2) if pad else bits
        data = torch.cat([data, data.new_zeros(b, h, pad, dt * TILE)], 2) if pad else data
    slots = TILE * (d if kind == "keys" else dt * TILE)
    bits = bits.reshape(b * h * nb, slots)
    data = data.reshape(b * h * nb, slots)
    offsets = _offsets(bits.sum(-1), align_elements(x.dtype))
    nz = torch.zeros(int(offsets[-1]), dtype=x.dtype, device=x.device)
    addr = offsets[:-1, None] + bits.to(torch.int64).cumsum(-1) - 1
    nz[addr[bits]] = data[bits]
    return BitmapTensor(kind, nz, bitmaps.contiguous(), offsets, tc, d)


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
def _block_words(raw, bitmap_ptr, g, bh, tok, tmask, Tc, D, IS_KEY: tl.constexpr, DP: tl.constexpr):
    """Store block ``g``'s bitmaps from its tile ``raw`` [64, DP] (token-major, as loaded) and return
    its 32-bit words in storage order, int32 [2 * DP] (keys: channel c's halves for tokens 0..31,
    32..63; values: each token's words, zero past the bitmaps' DT * 2 words)."""
    bits = (raw != 0).to(tl.int32)
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    if IS_KEY:  # two masked 32-bit reductions over the token axis as loaded: faster than one int64
        # reduction or a reshaped [2, 32, DP] tile
        sh = (t % 32)[:, None]
        lo = tl.sum(tl.where(t[:, None] < 32, bits << sh, 0), axis=0)  # [DP]
        hi = tl.sum(tl.where(t[:, None] >= 32, bits << sh, 0), axis=0)
        tl.store(bitmap_ptr + (g * D + c) * 2, lo, mask=c < D)
        tl.store(bitmap_ptr + (g * D + c) * 2 + 1, hi, mask=c < D)
        return tl.reshape(tl.join(lo, hi), (2 * DP,))
    else:  # token t's half-words: 32 consecutive channels each
        i32 = tl.arange(0, 32)
        words = tl.sum(tl.reshape(bits, (64, DP // 32, 32)) << i32[None, None, :], axis=2)  # [64, DP/32]
        p = tl.arange(0, DP // 32)
        dt2 = 2 * ((D + 63) // 64)
        tl.store(bitmap_ptr + (bh * Tc + tok[:, None]) * dt2 + p[None, :], words, mask=tmask[:, None] & (p[None, :] < dt2))
        return tl.reshape(words, (2 * DP,))


@triton.jit
def _pack_block(raw, words, dst_ptr, IS_KEY: tl.constexpr, DP: tl.constexpr, USE_ASM: tl.constexpr):
    """Write the stored elements of a tile ``raw`` [64, DP] (token-major) in storage order from
    ``dst_ptr`` on, placed by its words [2 * DP] (see :func:`_block_words`): element e of the
    storage-order tile lands at the exclusive prefix of the words' popcounts at word e // 32 + the
    popcount of the word's bits below e % 32. Returns how many were written."""
    if IS_KEY:
        vals = tl.trans(raw)  # storage order (channel, token)
    else:
        vals = raw  # storage order (token, channel)
    pc = _popc32(words, USE_ASM)
    bit = tl.arange(0, 32)[None, :]
    w = words[:, None]
    pos = (tl.cumsum(pc, axis=0) - pc)[:, None] + _popc32(w & ((tl.full([1, 32], 1, tl.int32) << bit) - 1), USE_ASM)  # [NW, 32]
    keep = ((w >> bit) & 1) != 0
    # One 1-D store in storage order. The [NW, 32] tensors above take Triton's default layout
    # (lanes along the 32 bits), which the flattening keeps: only the data tile changes layout (for
    # keys, its transposition). One warp store then covers one or two packed runs. A 2-D store gets
    # the layout Triton's pass picks for a data-dependent address (3.6: lanes along the first
    # axis), which sent the values' lanes to 32 different runs (pass 2 4x slower).
    tl.store(dst_ptr + tl.reshape(pos, (DP * 64,)).to(tl.int64), tl.reshape(vals, (DP * 64,)), mask=tl.reshape(keep, (DP * 64,)))
    return tl.sum(pc, axis=0)


@triton.jit
def _bitmap_compress_kernel(
    x_ptr,  # int view of the dense tensor [B*Hkv, Tc, D]
    bitmap_ptr,  # int32 view of the bitmaps: keys [B*Hkv, NB, D, 2]; values [B*Hkv, Tc, DT, 2]
    offset_ptr,  # int64 [B*Hkv*NB + 1]: pass 1 writes 0, then each block's count rounded up to ALIGN
    # (an in-place cumsum then makes them the offsets); pass 2 reads each block's start in nz
    nz_ptr,  # int view [total] (pass 2 writes)
    Tc,
    D,
    NB,
    IS_KEY: tl.constexpr,
    DP: tl.constexpr,  # power of two >= max(D, 64)
    WRITE: tl.constexpr,  # False: pass 1 (bitmaps, counts); True: pass 2 (packs nz, placed by pass 1's bitmaps)
    USE_ASM: tl.constexpr = False,  # popc.b32 (CUDA) instead of SWAR arithmetic
    ALIGN: tl.constexpr = 8,  # elements per 16 bytes: every block's run is padded to a multiple
):
    g = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    bh = g // NB
    tok = (g % NB) * 64 + t
    tmask = tok < Tc
    # Both passes load the block token-major [64, DP] (coalesced rows of the [Tc, D] tensor).
    raw = tl.load(x_ptr + bh * Tc * D + tok[:, None] * D + c[None, :], mask=tmask[:, None] & (c[None, :] < D), other=0)
    if WRITE:
        if IS_KEY:
            h = tl.arange(0, 2)
            w2 = tl.load(bitmap_ptr + (g * D + c[:, None]) * 2 + h[None, :], mask=(c[:, None] < D) & (h[None, :] < 2), other=0)  # [DP, 2]
        else:
            p = tl.arange(0, DP // 32)
            dt2 = 2 * ((D + 63) // 64)
            w2 = tl.load(bitmap_ptr + (bh * Tc + tok[:, None]) * dt2 + p[None, :], mask=tmask[:, None] & (p[None, :] < dt2), other=0)  # [64, DP/32]
        start = tl.load(offset_ptr + g)
        total = _pack_block(raw, tl.reshape(w2, (2 * DP,)), nz_ptr + start, IS_KEY, DP, USE_ASM)
        # zero the run's alignment padding (nz is allocated uninitialised): at most 7 elements
        pad = start + total + tl.arange(0, 8)
        tl.store(nz_ptr + pad, tl.zeros([8], dtype=nz_ptr.dtype.element_ty), mask=pad < tl.load(offset_ptr + g + 1))
    else:
        # the count from the words' popcounts: cheaper than summing the [64, DP] bits
        words = _block_words(raw, bitmap_ptr, g, bh, tok, tmask, Tc, D, IS_KEY, DP)
        cnt = tl.sum(_popc32(words, USE_ASM), axis=0).to(tl.int64)
        tl.store(offset_ptr + g + 1, (cnt + ALIGN - 1) // ALIGN * ALIGN)
        if g == 0:
            tl.store(offset_ptr, cnt * 0)


def _dp(d: int) -> int:
    return max(64, triton.next_power_of_2(d))


def encode_triton(x: torch.Tensor, kind: str) -> BitmapTensor:
    """Triton encoder (same bytes as :func:`encode_torch`). ``x`` ``[B, Hkv, Tc, D]`` on CUDA (or CPU
    under ``TRITON_INTERPRET=1``). One host sync: the total size of ``nz``."""
    check_input(x, kind)
    check_device(**{kind: x})
    b, h, tc, d = x.shape
    nb = -(-tc // TILE)
    dt = -(-d // TILE)
    x = x.contiguous()
    xi = x.view(_INT_VIEW[x.dtype])
    nblocks = b * h * nb
    shape = (b, h, nb, d) if kind == "keys" else (b, h, tc, dt)
    bitmaps = torch.empty(shape, dtype=torch.int64, device=x.device)  # pass 1 writes every word
    if nblocks == 0:
        return BitmapTensor(kind, x.new_zeros(0), bitmaps, torch.zeros(1, dtype=torch.int64, device=x.device), tc, d)
    offsets = torch.empty(nblocks + 1, dtype=torch.int64, device=x.device)  # pass 1: 0, padded counts
    # warps per pass from an H100 sweep (keys: 2 for pass 1, 8 for pass 2; values: 4 and 4)
    is_key = kind == "keys"
    warps1 = 2 if is_key else 4
    warps2 = 8 if is_key else 4
    use_asm = x.is_cuda and not interpreting()
    args = dict(IS_KEY=is_key, DP=_dp(d), USE_ASM=use_asm, ALIGN=align_elements(x.dtype))
    bm32 = bitmaps.view(torch.int32)
    _bitmap_compress_kernel[(nblocks,)](xi, bm32, offsets, xi, tc, d, nb, WRITE=False, num_warps=warps1, **args)
    offsets.cumsum_(0)  # one launch before the sync
    nz = torch.empty(int(offsets[-1]), dtype=x.dtype, device=x.device)  # pass 2 writes every element
    _bitmap_compress_kernel[(nblocks,)](xi, bm32, offsets, nz.view(_INT_VIEW[x.dtype]), tc, d, nb, WRITE=True, num_warps=warps2, **args)
    return BitmapTensor(kind, nz, bitmaps, offsets, tc, d)


def encode(x: torch.Tensor, kind: str, backend: str = "torch") -> BitmapTensor:
    """Encode with ``backend`` ``"torch"`` or ``"triton"``."""
    if backend == "triton":
        return encode_triton(x, kind)
    if backend == "torch":
        return encode_torch(x, kind)
    raise UsageError(f"backend must be torch or triton, got {backend!r}")


def encode_cache(keys: torch.Tensor, values: torch.Tensor, window: int = 0, backend: str = "torch") -> BitmapCache:
    """Pruned keys/values ``[B, Hkv, T, D]`` -> :class:`BitmapCache` whose last ``window`` tokens
    stay dense. For benchmarks: prune random tensors (:func:`random_pruned`) and encode them here, on the GPU with ``backend="triton"``."""
    if keys.shape != values.shape:
        raise UsageError(f"keys {list(keys.shape)} and values {list(values.shape)} must have one shape")
    t = keys.shape[2]
    if not 0 <= window <= t:
        raise UsageError(f"window {window} must be between 0 and the {t} tokens")
    tc = t - window
    ck = encode(keys[:, :, :tc], "keys", backend)
    cv = encode(values[:, :, :tc], "values", backend)
    return BitmapCache(ck, cv, keys[:, :, tc:].contiguous(), values[:, :, tc:].contiguous())


def random_pruned(batch: int, kv_heads: int, tokens: int, head_dim: int, sparsity: float, dtype=torch.float16, device="cpu", seed: int = 0, window: int = 0) -> torch.Tensor:
    """A random ``[B, Hkv, T, D]`` tensor pruned per token by magnitude to ``sparsity`` (the last
    ``window`` tokens untouched; each token keeps its ``round((1 - sparsity) * D)`` largest |x|):
    quick inputs for tests and benchmarks."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, kv_heads, tokens, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    tc = tokens - window
    if sparsity > 0 and tc > 0:
        part = x[:, :, :tc].float().abs()
        kept = int(round((1.0 - sparsity) * head_dim))
        keep = torch.zeros_like(part, dtype=torch.bool).scatter_(-1, part.topk(kept, dim=-1).indices, True)
        x[:, :, :tc] = x[:, :, :tc].masked_fill(~keep, 0)
    return x
