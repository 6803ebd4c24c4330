"""Decode attention over a bitmap-compressed cache plus its dense window (Triton), and the torch
reference of the same maths.

Entry point: :func:`bitmap_decode_attention` ``(q, cache, scale=None, num_splits=None,
validate=True) -> (out, lse)``

- ``q``: ``[B, H, Tq, D]`` float16 / bfloat16 (float32 works too), the cache's dtype and device; H a
  multiple of the cache's Hkv (query head h reads KV head ``h // G``). Decode is Tq = 1; Tq > 1 scores
  several queries against the same cache (no causal mask: every cached token precedes them).
- ``cache``: :class:`~.bitmap_layout.BitmapCache` (make one with
  :func:`~.bitmap_compress.encode_cache`).
- returns the partial of :mod:`kvtool.core.attention`: ``out`` ``[B, H, Tq, D]`` float32 (softmax-weighted
  values), ``lse`` ``[B, H, Tq]`` float32 (natural log-sum-exp of the scaled scores).

How it runs: grid ``(B * Hkv, S + 1)``. Program (bh, s < S) walks the 64-token blocks ``s * BPS ..``
of KV head bh, BPS = ceil(NB / S). For each block it expands K^T ``[D, 64]`` and V ``[64, D]`` to
dense tiles and scores all G * Tq query rows of the group at once (one pass over the group's data),
with an online softmax (base 2, float32) and P.V accumulated in float32. Program (bh, S) does the
same over the dense window. A second launch merges the S + 1 partials (flash-decoding combine,
:func:`kvtool.kernels.online_softmax.merge_splits_kernel`, shared with the heads and pages kernels).
Two expansions of a block, same result:

- ``walk`` (CUDA, 16-bit caches; the default there): each thread takes 32-bit bitmap words and walks
  their bits in inline PTX (:data:`WALK_PTX`): a set bit loads the next element of the word's packed
  run, a clear bit gives 0. A word's run starts at the block's offset + an exclusive prefix sum of
  the per-word popcounts, so there is one popcount per word, none per element.
- ``popc`` (the interpreter, float32, or ``expansion="popc"``): an element's place in its block's
  run is ``base + popcount(word & bits below it)``, on 3-D ``[rows, half-words, 32]`` bit tensors,
  one ``popc.b32`` per element on CUDA (SWAR arithmetic under the interpreter). CI runs this path;
  the GPU tests (``pytest -m gpu``) compare both with the reference.

The kernel is compiled with at most 128 registers per thread (``maxnreg``): unbounded, ptxas takes
254 and only two 4-warp programs fit on an SM; at 128 four fit, with no spills. S
(:func:`default_splits`): about 4 programs per SM under 32 KV heads in all, 16 above. Every load is
masked or bounded by the bitmaps; the offsets are validated before launch (``validate=True``) so no
gather leaves ``nz``. The walk is the default on CUDA because it was faster than the popcount
expansion at every configuration timed on the H100 (docs/benchmarks.md).

:func:`_expand_keys` / :func:`_expand_values` (one block to a dense tile) are shared with the
standalone SpMV products of :mod:`.bitmap_spmv`.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from kvtool.core.attention import attend_partial, default_scale
from kvtool.core.errors import UsageError
from kvtool.kernels.bitmap_compress import _popc32
from kvtool.kernels.bitmap_layout import TILE, BitmapCache
from kvtool.kernels.common import check_device, interpreting
from kvtool.kernels.online_softmax import attend_block as _attend_block, attend_dense_window, merge_split_partials, split_partials, store_split_partial

LOG2E = 1.4426950408889634


@triton.jit
def _key_words(kbm_ptr, g, c, cmask, D):
    """32-bit bitmap half-words ``[DP, 2]`` int32 of key block ``g`` (channel c: tokens 0-31, 32-63)."""
    halves = tl.arange(0, 2)
    return tl.load(kbm_ptr + (g * D + c[:, None]) * 2 + halves[None, :], mask=cmask[:, None], other=0)


@triton.jit
def _value_words(vbm_ptr, vrow, tmask, DT, DTP: tl.constexpr):
    """32-bit bitmap half-words ``[64, 2 * DTP]`` int32 of a value block's tokens (``vrow`` = bh * Tc
    + token; pieces past 2 * DT and tokens outside ``tmask`` read as 0)."""
    pieces = tl.arange(0, 2 * DTP)
    return tl.load(vbm_ptr + vrow[:, None] * (2 * DT) + pieces[None, :], mask=tmask[:, None] & (pieces[None, :] < 2 * DT), other=0)


@triton.jit
def _word_runs(words, USE_ASM: tl.constexpr):
    """Where each half-word's run starts in its block's packed elements, int32 ``[rows, pieces]``:
    the exclusive prefix sum of the popcounts in storage order (row by row, pieces within a row)."""
    pc = _popc32(words, USE_ASM)
    row = tl.sum(pc, axis=1)
    return (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(pc, axis=1) - pc


@triton.jit
def _expand_words_popc(words, nz_block, bit3, below3, USE_ASM: tl.constexpr):
    """Slots ``[rows, pieces, 32]`` of half-words ``[rows, pieces]`` whose runs start at
    ``nz_block``: each element at its run start + the popcount of the bits below it (0 where not
    stored)."""
    w3 = words[:, :, None]
    pos = _word_runs(words, USE_ASM)[:, :, None] + _popc32(w3 & below3, USE_ASM)
    return tl.load(nz_block + pos, mask=(w3 & bit3) != 0, other=0.0)


@triton.jit
def _expand_keys(kbm_ptr, knz_ptr, koff_ptr, g, c, cmask, D, bit3, below3, DP: tl.constexpr, USE_ASM: tl.constexpr):
    """Dense K^T tile ``[DP, 64]`` of key block ``g`` (channels x tokens, zeros where not stored)."""
    kw = _key_words(kbm_ptr, g, c, cmask, D)
    x = _expand_words_popc(kw, knz_ptr + tl.load(koff_ptr + g), bit3, below3, USE_ASM)
    return tl.reshape(x, (DP, 64))


@triton.jit
def _expand_values(vbm_ptr, vnz_ptr, voff_ptr, g, vrow, tmask, DT, bit3, below3, DP: tl.constexpr, DTP: tl.constexpr, USE_ASM: tl.constexpr):
    """Dense V tile ``[64, DP]`` of value block ``g`` (tokens x channels); ``vrow`` = bh * Tc + token."""
    vw = _value_words(vbm_ptr, vrow, tmask, DT, DTP)
    x = _expand_words_popc(vw, vnz_ptr + tl.load(voff_ptr + g), bit3, below3, USE_ASM)
    return tl.reshape(x, (64, DP))


def _walk_ptx() -> str:
    """PTX for one 32-bit bitmap word: walk its bits from the lowest, and for each set bit load the
    next element of the word's packed run (``ld.global.nc.b16``, address advanced by 2 bytes), for
    each clear bit give 0. Inputs: the word (``$32``) and the byte address of its run (``$33``);
    outputs ``$0 .. $31``: the word's 32 slots. About five instructions per slot, no popcount."""
    lines = ["{", ".reg .pred p;", ".reg .b32 t;", ".reg .b64 a;", "mov.b64 a, $33;"]
    for i in range(32):
        lines += [f"and.b32 t, $32, {1 << i};", "setp.ne.b32 p, t, 0;", f"mov.b16 ${i}, 0;", f"@p ld.global.nc.b16 ${i}, [a];", "@p add.u64 a, a, 2;"]
    lines.append("}")
    return "\n".join(lines)


WALK_PTX = _walk_ptx()


@triton.jit
def _walk_words(words, run_ptr, WALK: tl.constexpr):
    """16-bit slots ``[..., 32]`` of int32 bitmap words ``[...]`` whose packed runs start at the
    pointers ``run_ptr`` ``[...]`` (CUDA only: inline PTX :data:`WALK_PTX`)."""
    o = tl.inline_asm_elementwise(WALK, "=h," * 32 + "r,l", [words, run_ptr.to(tl.int64, bitcast=True)], dtype=(tl.float16,) * 32, is_pure=True, pack=1)
    j0_0 = tl.join(o[0], o[1])
    j0_1 = tl.join(o[2], o[3])
    j0_2 = tl.join(o[4], o[5])
    j0_3 = tl.join(o[6], o[7])
    j0_4 = tl.join(o[8], o[9])
    j0_5 = tl.join(o[10], o[11])
    j0_6 = tl.join(o[12], o[13])
    j0_7 = tl.join(o[14], o[15])
    j0_8 = tl.join(o[16], o[17])
    j0_9 = tl.join(o[18], o[19])
    j0_10 = tl.join(o[20], o[21])
    j0_11 = tl.join(o[22], o[23])
    j0_12 = tl.join(o[24], o[25])
    j0_13 = tl.join(o[26], o[27])
    j0_14 = tl.join(o[28], o[29])
    j0_15 = tl.join(o[30], o[31])
    j1_0 = tl.join(j0_0, j0_1)
    j1_1 = tl.join(j0_2, j0_3)
    j1_2 = tl.join(j0_4, j0_5)
    j1_3 = tl.join(j0_6, j0_7)
    j1_4 = tl.join(j0_8, j0_9)
    j1_5 = tl.join(j0_10, j0_11)
    j1_6 = tl.join(j0_12, j0_13)
    j1_7 = tl.join(j0_14, j0_15)
    j2_0 = tl.join(j1_0, j1_1)
    j2_1 = tl.join(j1_2, j1_3)
    j2_2 = tl.join(j1_4, j1_5)
    j2_3 = tl.join(j1_6, j1_7)
    j3_0 = tl.join(j2_0, j2_1)
    j3_1 = tl.join(j2_2, j2_3)
    j4_0 = tl.join(j3_0, j3_1)
    x = j4_0  # [..., 2 (bit 0), 2, 2, 2, 2 (bit 4)]
    return x


@triton.jit
def _expand_keys_walk(kbm_ptr, knz_ptr, koff_ptr, g, c, cmask, D, DP: tl.constexpr, WALK: tl.constexpr):
    """Same tile as :func:`_expand_keys`, each 32-bit word expanded by :func:`_walk_words`."""
    kw = _key_words(kbm_ptr, g, c, cmask, D)
    x = _walk_words(kw, knz_ptr + tl.load(koff_ptr + g) + _word_runs(kw, True), WALK)  # [DP, 2, 2, 2, 2, 2, 2]
    x = tl.permute(x, (0, 1, 6, 5, 4, 3, 2))
    return tl.reshape(x, (DP, 64)).to(knz_ptr.dtype.element_ty, bitcast=True)


@triton.jit
def _expand_values_walk(vbm_ptr, vnz_ptr, voff_ptr, g, vrow, tmask, DT, DP: tl.constexpr, DTP: tl.constexpr, WALK: tl.constexpr):
    """Same tile as :func:`_expand_values`, each 32-bit word expanded by :func:`_walk_words`."""
    vw = _value_words(vbm_ptr, vrow, tmask, DT, DTP)
    x = _walk_words(vw, vnz_ptr + tl.load(voff_ptr + g) + _word_runs(vw, True), WALK)  # [64, 2 * DTP, 2, 2, 2, 2, 2]
    x = tl.permute(x, (0, 1, 6, 5, 4, 3, 2))
    return tl.reshape(x, (64, DP)).to(vnz_ptr.dtype.element_ty, bitcast=True)


@triton.jit
def _bitmap_attention_kernel(
    q_ptr, kbm_ptr, knz_ptr, koff_ptr, vbm_ptr, vnz_ptr, voff_ptr, wk_ptr, wv_ptr, acc_ptr, m_ptr, l_ptr,
    scale_log2, Tc, W, D, DT, NB, R, BPS, S,
    RP: tl.constexpr, DP: tl.constexpr, DTP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    WALK: tl.constexpr, RB: tl.constexpr,
):
    """One program: token blocks [split * BPS, (split + 1) * BPS) of KV head bh (split < S) or the
    dense window (split == S), query rows [RB * chunk, RB * (chunk + 1)) of the R = G * Tq rows
    (chunk = program 2; RB <= 32: larger dot tiles fail to compile at head_dim 128, e.g. 64 held-out
    queries in fp16); partial (acc, m, l) to slot (bh, split).
    q [B*Hkv, R, D]; int32 views of keys.bitmaps [B*Hkv, NB, D, 2] and values.bitmaps
    [B*Hkv, Tc, DT, 2]; offsets int64; window [B*Hkv, W, D]; acc float32 [B*Hkv, S+1, RP, DP]."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.program_id(2) * RB + tl.arange(0, RB)
    rmask = rows < R
    c = tl.arange(0, DP)
    t = tl.arange(0, 64)
    cmask = c < D
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    m_i = tl.full([RB], float("-inf"), tl.float32)
    l_i = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, DP], tl.float32)
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
            if WALK != "":
                kt = _expand_keys_walk(kbm_ptr, knz_ptr, koff_ptr, g, c, cmask, D, DP, WALK)
                v = _expand_values_walk(vbm_ptr, vnz_ptr, voff_ptr, g, bh * Tc + tok, tmask, DT, DP, DTP, WALK)
            else:
                kt = _expand_keys(kbm_ptr, knz_ptr, koff_ptr, g, c, cmask, D, bit3, below3, DP, USE_ASM)
                v = _expand_values(vbm_ptr, vnz_ptr, voff_ptr, g, bh * Tc + tok, tmask, DT, bit3, below3, DP, DTP, USE_ASM)
            m_i, l_i, acc = _attend_block(q, kt, v, tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    else:
        m_i, l_i, acc = attend_dense_window(q, wk_ptr, wv_ptr, bh, W, D, c, cmask, m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    store_split_partial(acc_ptr, m_ptr, l_ptr, bh * (S + 1) + split, rows, rmask, c, acc, m_i, l_i, RP, DP)


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
    """Token-axis splits per KV head: about 4 programs per SM when there are few KV heads (under 32:
    batch 1 of an 8-KV-head model), else about 16, at least 2 blocks per program; 1 on the CPU.
    On the H100, 0.5x to 8x these splits were no faster at any configuration timed."""
    if blocks == 0 or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = 4 if bh < 32 else 16
    return max(1, min(-(-blocks // 2), -(-per_sm * sms // max(bh, 1))))


def expansion_options(x: torch.Tensor, dp: int, expansion: str | None = None, maxnreg: int | None = 128) -> dict:
    """Launch options of the kernels that expand bitmap blocks (this module's and
    :mod:`.bitmap_spmv`'s) for tensors like ``x`` and padded head_dim ``dp``: the ``USE_ASM`` and
    ``WALK`` constexprs (``expansion`` None picks walk where it can run) and the register cap (CUDA,
    ``dp`` <= 128). UsageError for an unknown expansion or walk where it cannot run."""
    use_asm = x.is_cuda and not interpreting()
    can_walk = use_asm and x.dtype != torch.float32
    if expansion not in (None, "walk", "popc"):
        raise UsageError(f"expansion must be walk or popc, got {expansion!r}")
    if expansion == "walk" and not can_walk:
        raise UsageError("the walk expansion needs CUDA and 16-bit caches (inline PTX); use expansion='popc'")
    walk = can_walk if expansion is None else expansion == "walk"
    return dict(USE_ASM=use_asm, WALK=WALK_PTX if walk else "", **({"maxnreg": maxnreg} if maxnreg and use_asm and dp <= 128 else {}))


def bitmap_decode_attention(
    q: torch.Tensor,
    cache: BitmapCache,
    scale: float | None = None,
    num_splits: int | None = None,
    validate: bool = True,
    num_warps: int = 4,
    num_stages: int = 1,
    expansion: str | None = None,
    maxnreg: int | None = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, Tq, D]`` over the compressed tokens and the dense window of
    ``cache``: the partial (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32). See the module
    docstring. ``validate=False`` skips the layout check (only for a cache validated before: the
    kernel trusts the offsets). ``num_splits`` (token-axis programs per KV head), ``num_warps`` and
    ``num_stages`` are tuning knobs; the result does not depend on them beyond rounding. One stage
    (no software pipelining of the block loop) was as fast or faster on the H100 in the
    configurations timed. ``expansion``: ``"walk"`` / ``"popc"`` (see the module docstring; None
    picks walk where it can run). ``maxnreg``: register cap per thread on CUDA for head_dim <= 128
    (None: no cap)."""
    check_query(q, cache)
    check_device(q=q)
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
    acc, m, l = split_partials(bh, splits + 1, rows, d, q.device)
    rp, dp = acc.shape[2], acc.shape[3]
    scale = default_scale(d) if scale is None else scale
    qc = q.contiguous()
    # the interpreter gets bfloat16 tl.dot wrong: there, bfloat16 products run in float32
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    empty = torch.zeros(1, dtype=q.dtype, device=q.device)
    rb = min(rp, 32)
    _bitmap_attention_kernel[(bh, splits + 1, -(-rows // rb))](
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
        DTP=dp // TILE,
        DOT_PREC=prec,
        UPCAST=upcast,
        RB=rb,
        num_warps=num_warps,
        num_stages=num_stages,
        **expansion_options(q, dp, expansion, maxnreg),
    )
    merge_split_partials(acc, m, l, out, lse, rows)
    return out, lse


def kernel_bytes(cache: BitmapCache, q: torch.Tensor | None = None) -> int:
    """Bytes one call of :func:`bitmap_decode_attention` must read from memory: every tensor of the
    cache (packed elements, bitmaps, offsets, window) plus ``q`` when given (outputs not counted)."""
    parts = [cache.keys.nz, cache.keys.bitmaps, cache.keys.offsets, cache.values.nz, cache.values.bitmaps, cache.values.offsets, cache.window_keys, cache.window_values]
    if q is not None:
        parts.append(q)
    return sum(t.numel() * t.element_size() for t in parts)


def bitmap_attention_reference(q: torch.Tensor, cache: BitmapCache, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: decode the layout and run :func:`kvtool.core.attention.attend_partial`."""
    keys, values = cache.decode()
    return attend_partial(q, keys, values, scale)
