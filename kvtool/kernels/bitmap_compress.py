"""Bitmap compression: a pruned dense tensor -> the bitmap layout of :mod:`.bitmap_layout`.

Two encoders that produce identical bytes:

- :func:`encode_torch` (plain torch, any device);
- :func:`encode_triton` (Triton, two passes over the data, each loading a block as coalesced
  ``[64 tokens, D]`` rows: pass 1 writes each block's bitmaps (keys: per-channel words by a reduction
  over the token axis) and its count, the host turns the padded counts into offsets with one cumsum,
  pass 2 packs the non-zeros: keys at their run start + exclusive scans (``tl.cumsum``) in storage
  order, scattered stores; values the same way, or, for 16-bit values with more than 40% of the
  elements stored, by sorting each token's channels on (not stored, channel, value bits) so that its
  stored elements come first, then one contiguous store per token).
  CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. H100 (batch 8, 32k tokens, D 128,
  docs/benchmarks.md): pass 1 runs at 52% (keys) and 96% (values) of copy bandwidth; pass 2 is
  bound by L2 write traffic (ncu: 74% excess sectors from 2-byte scattered stores, L2 at 79%), so
  the whole encoder stays at 15-21% of copy.

Input ``x``: ``[B, Hkv, Tc, D]`` float16 / bfloat16 / float32, the pruned keys or values (pruned
elements +0.0). An element is stored when its bit pattern is not all zero. :func:`encode_cache`
builds a whole :class:`~.bitmap_layout.BitmapCache` (keys, values, dense window) and is the quick
way to make kernel inputs of any size on the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..errors import UsageError
from .bitmap_layout import _INT_VIEW, TILE, BitmapCache, BitmapTensor, align_elements, bits_to_words, nonzero_bits


def _check_input(x: torch.Tensor, kind: str) -> None:
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
    _check_input(x, kind)
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
def _bitmap_compress_kernel(
    x_ptr,  # int view of the dense tensor [B*Hkv, Tc, D]
    bitmap_ptr,  # int32 view of the bitmaps: keys [B*Hkv, NB, D, 2]; values [B*Hkv, Tc, DT, 2]
    count_ptr,  # int64 [B*Hkv*NB] (pass 1 writes)
    offset_ptr,  # int64 [B*Hkv*NB + 1] (pass 2 reads)
    nz_ptr,  # int view [total] (pass 2 writes)
    Tc,
    D,
    NB,
    IS_KEY: tl.constexpr,
    DP: tl.constexpr,  # power of two >= max(D, 64)
    WRITE: tl.constexpr,  # False: pass 1 (bitmaps, counts); True: pass 2 (non-zeros)
    SORT: tl.constexpr = False,  # pass 2, values, 16-bit data: compact each token by a sort, contiguous stores
):
    g = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    i32 = tl.arange(0, 32)
    bh = g // NB
    tok = (g % NB) * 64 + t
    tmask = tok < Tc
    # Both kinds load the block token-major [64, DP] (coalesced rows of the [Tc, D] tensor).
    m = tmask[:, None] & (c[None, :] < D)
    raw = tl.load(x_ptr + bh * Tc * D + tok[:, None] * D + c[None, :], mask=m, other=0)
    bits = (raw != 0).to(tl.int32)
    if not WRITE:
        if IS_KEY:  # channel c's word halves: tokens 0..31 and 32..63, a reduction over tokens
            words = tl.sum(tl.reshape(bits, (2, 32, DP)) << i32[None, :, None], axis=1)  # [2, DP]
            h = tl.arange(0, 2)
            tl.store(bitmap_ptr + (g * D + c[None, :]) * 2 + h[:, None], words, mask=c[None, :] < D)
        else:  # token t's half-words: 32 consecutive channels each
            words = tl.sum(tl.reshape(bits, (64, DP // 32, 32)) << i32[None, None, :], axis=2)  # [64, DP/32]
            p = tl.arange(0, DP // 32)
            dt2 = 2 * ((D + 63) // 64)
            tl.store(bitmap_ptr + (bh * Tc + tok[:, None]) * dt2 + p[None, :], words, mask=tmask[:, None] & (p[None, :] < dt2))
        tl.store(count_ptr + g, tl.sum(tl.sum(bits, axis=1), axis=0).to(tl.int64))
    else:
        start = tl.load(offset_ptr + g)
        if SORT:
            # values only: each token's DP channels sorted on (not stored, channel, 16 value
            # bits) put its stored elements first, in storage order; then each token's run is
            # one contiguous, coalesced store (for keys the sort of the transposed tile was 15x
            # slower on the H100, so keys always take the scans)
            tile = raw.to(tl.int32) & 0xFFFF  # [64, DP]
            idx = c[None, :]
            kept = tile != 0
            srt = tl.sort(tl.where(kept, 0, 1 << 24) | (idx << 16) | tile, dim=1)
            cnt = tl.sum(kept.to(tl.int32), axis=1)
            base = tl.cumsum(cnt, axis=0) - cnt
            tl.store(nz_ptr + start + (base[:, None] + idx).to(tl.int64), (srt & 0xFFFF).to(nz_ptr.dtype.element_ty), mask=idx < cnt[:, None])
        else:
            # storage position = exclusive scans: (channel, token) order for keys, (token, channel) for values
            if IS_KEY:
                col = tl.sum(bits, axis=0)
                pos = (tl.cumsum(col, axis=0) - col)[None, :] + tl.cumsum(bits, axis=0) - bits
            else:
                row = tl.sum(bits, axis=1)
                pos = (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(bits, axis=1) - bits
            tl.store(nz_ptr + start + pos.to(tl.int64), raw, mask=bits != 0)
        # zero the run's alignment padding (nz is allocated uninitialised): at most 7 elements
        end = tl.load(offset_ptr + g + 1)
        pad = start + tl.sum(tl.sum(bits, axis=1), axis=0) + tl.arange(0, 8)
        tl.store(nz_ptr + pad, tl.zeros([8], dtype=nz_ptr.dtype.element_ty), mask=pad < end)


def _check_device(x: torch.Tensor, what: str) -> None:
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise UsageError(f"{what} is on {x.device}; the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")


def _dp(d: int) -> int:
    return max(64, triton.next_power_of_2(d))


def encode_triton(x: torch.Tensor, kind: str) -> BitmapTensor:
    """Triton encoder (same bytes as :func:`encode_torch`). ``x`` ``[B, Hkv, Tc, D]`` on CUDA (or CPU
    under ``TRITON_INTERPRET=1``). One host sync: the total size of ``nz``."""
    return _encode_triton(x, kind)


def _encode_triton(x: torch.Tensor, kind: str, num_warps: int | None = None, sort: bool | None = None, maxnreg: int | None = None) -> BitmapTensor:
    """:func:`encode_triton` with the launch settings open (``scripts/try_compress.py`` sweeps them)."""
    _check_input(x, kind)
    _check_device(x, kind)
    b, h, tc, d = x.shape
    nb = -(-tc // TILE)
    dt = -(-d // TILE)
    x = x.contiguous()
    xi = x.view(_INT_VIEW[x.dtype])
    nblocks = b * h * nb
    shape = (b, h, nb, d) if kind == "keys" else (b, h, tc, dt)
    bitmaps = torch.zeros(shape, dtype=torch.int64, device=x.device)
    counts = torch.zeros(nblocks, dtype=torch.int64, device=x.device)
    if nblocks == 0:
        return BitmapTensor(kind, x.new_zeros(0), bitmaps, counts.new_zeros(1), tc, d)
    dp = _dp(d)
    is_key = kind == "keys"
    # H100, batch 8 / 32k / D 128 (scripts/try_compress.py, docs/benchmarks.md): pass 1 fastest with
    # 4 warps (keys 360 µs vs 650 with 8); pass 2 of keys fastest with 4 warps and the direct store
    # (0.91 ms vs 1.42 ms with 8 warps, 2.1 ms storing a transposed tile, at 50%); pass 2 of values fastest as a
    # sort with 8 warps at 50% sparsity (1.58 ms vs 2.4 ms for the scans) but not at 70% (1.58 vs
    # 1.29 ms): the sort is chosen from the stored fraction, known after pass 1
    warps1 = num_warps if num_warps is not None else 4
    warps2 = num_warps if num_warps is not None else (4 if is_key else 8)
    args = dict(IS_KEY=is_key, DP=dp)
    bm32 = bitmaps.view(torch.int32)
    _bitmap_compress_kernel[(nblocks,)](xi, bm32, counts, counts, xi, tc, d, nb, WRITE=False, num_warps=warps1, **args)
    offsets = _offsets(counts, align_elements(x.dtype))
    nz = torch.empty(int(offsets[-1]), dtype=x.dtype, device=x.device)  # pass 2 writes every element
    if sort is None:  # the sort wins when many elements are stored (H100: 1.95 vs 2.7 ms at 50%, 1.95 vs 1.6 ms at 30% stored)
        sort = nz.numel() > 0.4 * x.numel()
    _bitmap_compress_kernel[(nblocks,)](xi, bm32, counts, offsets, nz.view(_INT_VIEW[x.dtype]), tc, d, nb, WRITE=True,
                                        SORT=sort and not is_key and x.element_size() == 2, num_warps=warps2,
                                        **({"maxnreg": maxnreg} if maxnreg and x.is_cuda else {}), **args)
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
    stay dense. For benchmarks: prune random tensors with :func:`kvtool.prune.per_token_mask` (or
    :func:`random_pruned`) and encode them here, on the GPU with ``backend="triton"``."""
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
    ``window`` tokens untouched): quick inputs for tests and benchmarks."""
    from ..prune import per_token_mask

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, kv_heads, tokens, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    tc = tokens - window
    if sparsity > 0 and tc > 0:
        keep = per_token_mask(x[:, :, :tc].float().abs(), sparsity)
        x[:, :, :tc] = x[:, :, :tc].masked_fill(~keep, 0)
    return x
