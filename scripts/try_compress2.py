"""Time variants of the bitmap encoder's store and key-word layouts on the GPU (fourth session).

Why: Triton 3.6 gives the pass-2 store of the library kernel the layout ``threadsPerWarp [32, 1]``
(lanes along the tile's first axis, tokens): right for keys, whose runs are (channel, token), wrong
for values, whose runs are (token, channel): one warp store then touches 32 token runs, 2 bytes
each. Triton 3.9 breaks the same tie the other way. Variants:

- ``lib``: the library kernel (``encode_triton``'s settings);
- ``flat``: pass 2 stores a 1-D tensor in storage order (values: the tile row-major; keys: the
  transposed tile), so lanes run along the packed runs whatever the tie rule;
- ``keyt``: pass 1 of keys builds the channel words from the transposed tile (reduction along the
  last axis) instead of reducing over the token axis;
- ``_w{4,8}``: warps of both passes.

Every variant's bytes (nz, bitmaps, offsets) are compared with ``encode_torch`` first. Timing: the
bench's Timer (cold L2, launches hidden behind a GPU sleep); pass 1 and pass 2 alone, and the whole
encoder (both passes, the host sync for ``len(nz)``, allocations). Bytes = read + written, like a
copy; fraction = over the copy bandwidth measured in the same run.

    python scripts/try_compress2.py [--json PATH] [--variants a,b]     # CUDA, repo root
    TRITON_INTERPRET=1 python scripts/try_compress2.py --tiny           # CPU check of every variant
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool import bench as B  # noqa: E402
from kvtool.kernels import bitmap_compress as C  # noqa: E402
from kvtool.kernels.bitmap_layout import _INT_VIEW, TILE, align_elements  # noqa: E402


@triton.jit
def _variant_kernel(x_ptr, bitmap_ptr, count_ptr, offset_ptr, nz_ptr, Tc, D, NB,
                    IS_KEY: tl.constexpr, DP: tl.constexpr, WRITE: tl.constexpr, FLAT: tl.constexpr, KEYT: tl.constexpr,
                    SMALLPOS: tl.constexpr = False, USE_ASM: tl.constexpr = False):
    g = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    i32 = tl.arange(0, 32)
    bh = g // NB
    tok = (g % NB) * 64 + t
    tmask = tok < Tc
    m = tmask[:, None] & (c[None, :] < D)
    raw = tl.load(x_ptr + bh * Tc * D + tok[:, None] * D + c[None, :], mask=m, other=0)
    bits = (raw != 0).to(tl.int32)
    if not WRITE:
        if IS_KEY:
            h = tl.arange(0, 2)
            if KEYT == 3:  # two 32-bit reductions over the token axis as loaded, masked halves
                sh = (t % 32)[:, None]
                lo = tl.sum(tl.where(t[:, None] < 32, bits << sh, 0), axis=0)
                hi = tl.sum(tl.where(t[:, None] >= 32, bits << sh, 0), axis=0)
                tl.store(bitmap_ptr + (g * D + c) * 2, lo, mask=c < D)
                tl.store(bitmap_ptr + (g * D + c) * 2 + 1, hi, mask=c < D)
            elif KEYT == 2:  # one 64-bit word per channel, a reduction over the token axis as loaded
                w64 = tl.sum(bits.to(tl.int64) << t[:, None].to(tl.int64), axis=0)  # [DP]
                tl.store(bitmap_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + g * D + c, w64, mask=c < D)
            elif KEYT:
                bt = tl.trans(bits)  # [DP, 64]
                words = tl.sum(tl.reshape(bt, (DP, 2, 32)) << i32[None, None, :], axis=2)  # [DP, 2]
                tl.store(bitmap_ptr + (g * D + c[:, None]) * 2 + h[None, :], words, mask=c[:, None] < D)
            else:
                words = tl.sum(tl.reshape(bits, (2, 32, DP)) << i32[None, :, None], axis=1)  # [2, DP]
                tl.store(bitmap_ptr + (g * D + c[None, :]) * 2 + h[:, None], words, mask=c[None, :] < D)
        else:
            words = tl.sum(tl.reshape(bits, (64, DP // 32, 32)) << i32[None, None, :], axis=2)
            p = tl.arange(0, DP // 32)
            dt2 = 2 * ((D + 63) // 64)
            tl.store(bitmap_ptr + (bh * Tc + tok[:, None]) * dt2 + p[None, :], words, mask=tmask[:, None] & (p[None, :] < dt2))
        tl.store(count_ptr + g, tl.sum(tl.sum(bits, axis=1), axis=0).to(tl.int64))
    else:
        start = tl.load(offset_ptr + g)
        if IS_KEY and FLAT == 2:
            # ranks from the channel words pass 1 wrote: no scan over the token axis
            h = tl.arange(0, 2)
            wd = tl.load(bitmap_ptr + (g * D + c[:, None]) * 2 + h[None, :], mask=(c[:, None] < D) & (h[None, :] < 2), other=0)  # [DP, 2]
            w0, w1 = tl.split(wd)
            p0 = C._popc32(w0, USE_ASM)
            cnt = p0 + C._popc32(w1, USE_ASM)
            cstart = tl.cumsum(cnt, axis=0) - cnt  # [DP]
            lo = t[None, :] < 32
            word = tl.where(lo, w0[:, None], w1[:, None])  # [DP, 64]
            sh = (t % 32)[None, :]
            below = word & ((tl.full([1, 64], 1, tl.int32) << sh) - 1)
            where = cstart[:, None] + tl.where(lo, 0, p0[:, None]) + C._popc32(below, USE_ASM)
            keep = ((word >> sh) & 1) != 0
            vals = tl.reshape(tl.trans(raw), (DP * 64,))
            if SMALLPOS:
                where = where.to(tl.int16)
            where = tl.reshape(where, (DP * 64,))
            keep = tl.reshape(keep, (DP * 64,))
            tl.store(nz_ptr + start + where.to(tl.int64), vals, mask=keep)
        elif IS_KEY:
            col = tl.sum(bits, axis=0)
            pos = (tl.cumsum(col, axis=0) - col)[None, :] + tl.cumsum(bits, axis=0) - bits
        else:
            row = tl.sum(bits, axis=1)
            pos = (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(bits, axis=1) - bits
        if SMALLPOS and not (IS_KEY and FLAT == 2):
            pos = pos.to(tl.int16)
        if IS_KEY and FLAT == 2:
            pass
        elif FLAT:
            keep = bits != 0
            if IS_KEY:
                vals = tl.reshape(tl.trans(raw), (DP * 64,))
                where = tl.reshape(tl.trans(pos), (DP * 64,))
                keep = tl.reshape(tl.trans(keep), (DP * 64,))
            else:
                vals = tl.reshape(raw, (DP * 64,))
                where = tl.reshape(pos, (DP * 64,))
                keep = tl.reshape(keep, (DP * 64,))
            tl.store(nz_ptr + start + where.to(tl.int64), vals, mask=keep)
        else:
            tl.store(nz_ptr + start + pos.to(tl.int64), raw, mask=bits != 0)
        end = tl.load(offset_ptr + g + 1)
        pad = start + tl.sum(tl.sum(bits, axis=1), axis=0) + tl.arange(0, 8)
        tl.store(nz_ptr + pad, tl.zeros([8], dtype=nz_ptr.dtype.element_ty), mask=pad < end)


@triton.jit
def _load_block(x_ptr, g, Tc, D, NB, DP: tl.constexpr):
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    bh = g // NB
    tok = (g % NB) * 64 + t
    m = (tok[:, None] < Tc) & (c[None, :] < D)
    return tl.load(x_ptr + bh * Tc * D + tok[:, None] * D + c[None, :], mask=m, other=0)


@triton.jit
def _pack_block(raw, g, bitmap_ptr, offset_ptr, nz_ptr, D, IS_KEY: tl.constexpr, DP: tl.constexpr, USE_ASM: tl.constexpr):
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    start = tl.load(offset_ptr + g)
    if IS_KEY:
        h = tl.arange(0, 2)
        wd = tl.load(bitmap_ptr + (g * D + c[:, None]) * 2 + h[None, :], mask=(c[:, None] < D) & (h[None, :] < 2), other=0)
        w_lo, w_hi = tl.split(wd)
        pc_lo = C._popc32(w_lo, USE_ASM)
        cnt = pc_lo + C._popc32(w_hi, USE_ASM)
        lo = t[None, :] < 32
        word = tl.where(lo, w_lo[:, None], w_hi[:, None])
        sh = (t % 32)[None, :]
        below = word & ((tl.full([1, 64], 1, tl.int32) << sh) - 1)
        pos = (tl.cumsum(cnt, axis=0) - cnt)[:, None] + tl.where(lo, 0, pc_lo[:, None]) + C._popc32(below, USE_ASM)
        keep = ((word >> sh) & 1) != 0
        vals = tl.trans(raw)
        total = tl.sum(cnt, axis=0)
    else:
        bits = (raw != 0).to(tl.int32)
        row = tl.sum(bits, axis=1)
        pos = (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(bits, axis=1) - bits
        keep = bits != 0
        vals = raw
        total = tl.sum(row, axis=0)
    tl.store(nz_ptr + start + tl.reshape(pos, (DP * 64,)).to(tl.int64), tl.reshape(vals, (DP * 64,)), mask=tl.reshape(keep, (DP * 64,)))
    end = tl.load(offset_ptr + g + 1)
    pad = start + total + tl.arange(0, 8)
    tl.store(nz_ptr + pad, tl.zeros([8], dtype=nz_ptr.dtype.element_ty), mask=pad < end)


@triton.jit
def _pass2_persistent(x_ptr, bitmap_ptr, offset_ptr, nz_ptr, Tc, D, NB, NBLK,
                      IS_KEY: tl.constexpr, DP: tl.constexpr, USE_ASM: tl.constexpr, PREFETCH: tl.constexpr):
    """Pass 2 over blocks pid, pid + P, ...; with PREFETCH the next block's load is issued before
    the current block is packed (a register double buffer)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if PREFETCH:
        nxt = _load_block(x_ptr, tl.minimum(pid, NBLK - 1).to(tl.int64), Tc, D, NB, DP)
        for gi in range(pid, NBLK, nprog):
            g = tl.cast(gi, tl.int64)
            raw = nxt
            nxt = _load_block(x_ptr, tl.minimum(g + nprog, NBLK - 1), Tc, D, NB, DP)
            _pack_block(raw, g, bitmap_ptr, offset_ptr, nz_ptr, D, IS_KEY, DP, USE_ASM)
    else:
        for gi in range(pid, NBLK, nprog):
            g = tl.cast(gi, tl.int64)
            _pack_block(_load_block(x_ptr, g, Tc, D, NB, DP), g, bitmap_ptr, offset_ptr, nz_ptr, D, IS_KEY, DP, USE_ASM)


@triton.jit
def _pass2_words(x_ptr, bitmap_ptr, offset_ptr, nz_ptr, Tc, D, NB, IS_KEY: tl.constexpr, DP: tl.constexpr, USE_ASM: tl.constexpr,
                 EVICT: tl.constexpr = ""):
    """The library's pass 2 (words from pass 1's bitmaps, :func:`C._pack_block`), with an eviction
    policy on the data load."""
    g = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    bh = g // NB
    tok = (g % NB) * 64 + t
    tmask = tok < Tc
    raw = tl.load(x_ptr + bh * Tc * D + tok[:, None] * D + c[None, :], mask=tmask[:, None] & (c[None, :] < D), other=0, eviction_policy=EVICT)
    if IS_KEY:
        h = tl.arange(0, 2)
        w2 = tl.load(bitmap_ptr + (g * D + c[:, None]) * 2 + h[None, :], mask=(c[:, None] < D) & (h[None, :] < 2), other=0)  # [DP, 2]
    else:
        p = tl.arange(0, DP // 32)
        dt2 = 2 * ((D + 63) // 64)
        w2 = tl.load(bitmap_ptr + (bh * Tc + tok[:, None]) * dt2 + p[None, :], mask=tmask[:, None] & (p[None, :] < dt2), other=0)  # [64, DP/32]
    start = tl.load(offset_ptr + g)
    total = C._pack_block(raw, tl.reshape(w2, (2 * DP,)), nz_ptr + start, IS_KEY, DP, USE_ASM)
    pad = start + total + tl.arange(0, 8)
    tl.store(nz_ptr + pad, tl.zeros([8], dtype=nz_ptr.dtype.element_ty), mask=pad < tl.load(offset_ptr + g + 1))


def variant(flat: int, keyt: bool, warps1: int, warps2: int, smallpos: bool = False, per_sm: int | None = None,
            prefetch: bool = False, maxnreg: int | None = None, evict: str = ""):
    """Pass 1 and pass 2 closures; ``per_sm`` set: pass 2 is the persistent kernel (``flat`` 2
    maths), ``per_sm`` programs per SM."""
    def make(x, kind):
        b, h, tc, d = x.shape
        nb = -(-tc // TILE)
        dt = -(-d // TILE)
        shape = (b, h, nb, d) if kind == "keys" else (b, h, tc, dt)
        bitmaps = torch.zeros(shape, dtype=torch.int64, device=x.device)
        counts = torch.zeros(b * h * nb, dtype=torch.int64, device=x.device)
        xi = x.view(_INT_VIEW[x.dtype])
        bm32 = bitmaps.view(torch.int32)
        asm = x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        args = dict(IS_KEY=kind == "keys", DP=C._dp(d), FLAT=flat, KEYT=keyt, SMALLPOS=smallpos and 64 * C._dp(d) <= 2**15, USE_ASM=asm)
        grid = (b * h * nb,)

        def p1():
            _variant_kernel[grid](xi, bm32, counts, counts, xi, tc, d, nb, WRITE=False, num_warps=warps1, **args)

        extra = {"maxnreg": maxnreg} if maxnreg and x.is_cuda else {}

        def p2(offsets, nz):
            if per_sm == -1:
                _pass2_words[grid](xi, bm32, offsets, nz.view(_INT_VIEW[x.dtype]), tc, d, nb, IS_KEY=kind == "keys", DP=C._dp(d), USE_ASM=asm,
                                   num_warps=warps2, EVICT=evict, **extra)
            elif per_sm:
                sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
                _pass2_persistent[(min(grid[0], per_sm * sms),)](xi, bm32, offsets, nz.view(_INT_VIEW[x.dtype]), tc, d, nb, grid[0],
                                                                IS_KEY=kind == "keys", DP=C._dp(d), USE_ASM=asm, PREFETCH=prefetch,
                                                                num_warps=warps2, **extra)
            else:
                _variant_kernel[grid](xi, bm32, counts, offsets, nz.view(_INT_VIEW[x.dtype]), tc, d, nb, WRITE=True, num_warps=warps2, **args, **extra)

        def whole():
            p1()
            offsets = C._offsets(counts, align_elements(x.dtype))
            nz = torch.empty(int(offsets[-1]), dtype=x.dtype, device=x.device)
            p2(offsets, nz)
            return C.BitmapTensor(kind, nz, bitmaps, offsets, tc, d)

        return p1, p2, whole

    return make


def library(x, kind):
    """The library encoder, whole only. (``lib_one_read_w*`` / ``lib_two_reads`` in
    try_compress2h_h100.json: a one-read mode, removed after that run, that packed each block into
    a slot of an input-sized scratch and then copied the slots into nz.)"""
    def whole():
        return C.encode_triton(x, kind)
    return None, None, whole


VARIANTS = {"lib": library}
for _w1 in (4, 8):
    for _w2 in (4, 8):
        VARIANTS[f"flat_w{_w1}{_w2}"] = variant(True, False, _w1, _w2)
        VARIANTS[f"flat_keyt_w{_w1}{_w2}"] = variant(True, True, _w1, _w2)
for _w in (4, 8):
    VARIANTS[f"flat16_w4{_w}"] = variant(1, False, 4, _w, smallpos=True)
    VARIANTS[f"kpop_w4{_w}"] = variant(2, False, 4, _w)
    VARIANTS[f"kpop16_w4{_w}"] = variant(2, False, 4, _w, smallpos=True)
VARIANTS["kpop_k64_w48"] = variant(2, 2, 4, 8)
VARIANTS["kpop_k64_w88"] = variant(2, 2, 8, 8)
VARIANTS["kpop_k64_w28"] = variant(2, 2, 2, 8)
for _w in (2, 4, 8, 16):
    VARIANTS[f"words_w2{_w}"] = variant(2, 2, 2, _w, per_sm=-1)
VARIANTS["words_w44"] = variant(2, 2, 4, 4, per_sm=-1)
VARIANTS["words_k32_w28"] = variant(2, 3, 2, 8, per_sm=-1)
VARIANTS["words_k32_w24"] = variant(2, 3, 2, 4, per_sm=-1)
VARIANTS["words_k32_w28_ef"] = variant(2, 3, 2, 8, per_sm=-1, evict="evict_first")
VARIANTS["words_k32_w24_ef"] = variant(2, 3, 2, 4, per_sm=-1, evict="evict_first")
VARIANTS["words_k32_w48"] = variant(2, 3, 4, 8, per_sm=-1)
for _ps in (2, 4, 8):
    VARIANTS[f"pers{_ps}_w28"] = variant(2, 2, 2, 8, per_sm=_ps)
    VARIANTS[f"pers{_ps}_pf_w28"] = variant(2, 2, 2, 8, per_sm=_ps, prefetch=True)
for _r in (64, 80, 96):
    VARIANTS[f"kpop_k64_w28_r{_r}"] = variant(2, 2, 2, 8, maxnreg=_r)
    VARIANTS[f"pers4_pf_w28_r{_r}"] = variant(2, 2, 2, 8, per_sm=4, prefetch=True, maxnreg=_r)
VARIANTS["scan_w44"] = variant(False, False, 4, 4)
VARIANTS["scan_w48"] = variant(False, False, 4, 8)


def same(a, b):
    def raw(t):
        return t.reshape(-1).view(torch.uint8) if t.is_floating_point() else t
    return [n for n in ("nz", "bitmaps", "offsets") if not torch.equal(raw(getattr(a, n)), raw(getattr(b, n)))]


def host_gap(recs):
    """The library encoder's steps with CUDA events between them (launches queued behind a GPU
    sleep): pass 1, the gap (the offsets' cumsum, the host sync for len(nz), the allocation and
    the pass-2 launch, as the GPU sees it), pass 2."""
    x = C.random_pruned(8, 8, 32768, 128, 0.7, dtype=torch.float16, device="cuda", seed=1)
    xi = x.view(torch.int16)
    b, h, tc, d = x.shape
    nb = tc // 64
    n = b * h * nb
    for kind in ("keys", "values"):
        is_key = kind == "keys"
        shape = (b, h, nb, d) if is_key else (b, h, tc, 2)
        args = dict(IS_KEY=is_key, DP=128, USE_ASM=True, ALIGN=8)
        w1, w2 = (2, 8) if is_key else (4, 4)
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(12)]
        for i in range(12):
            torch.cuda._sleep(2_000_000)
            bitmaps = torch.empty(shape, dtype=torch.int64, device="cuda")
            offsets = torch.empty(n + 1, dtype=torch.int64, device="cuda")
            bm32 = bitmaps.view(torch.int32)
            ev[i][0].record()
            C._bitmap_compress_kernel[(n,)](xi, bm32, offsets, xi, tc, d, nb, WRITE=False, num_warps=w1, **args)
            ev[i][1].record()
            offsets.cumsum_(0)
            nz = torch.empty(int(offsets[-1]), dtype=x.dtype, device="cuda")
            ev[i][2].record()
            C._bitmap_compress_kernel[(n,)](xi, bm32, offsets, nz.view(torch.int16), tc, d, nb, WRITE=True, num_warps=w2, **args)
            ev[i][3].record()
        torch.cuda.synchronize()
        parts = [sorted(e[j].elapsed_time(e[j + 1]) * 1e3 for e in ev[2:]) for j in range(3)]
        med = [p[len(p) // 2] for p in parts]
        print(f"     {kind}: pass 1 {med[0]:.1f} µs, gap (cumsum, sync, allocation, launch) {med[1]:.1f} µs, pass 2 {med[2]:.1f} µs")
        recs.append(dict(kernel=f"bitmap_compress_{kind}", provider="lib_steps", pass1_us=med[0], gap_us=med[1], pass2_us=med[2]))
    del x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sparsity", default="0.5,0.7")
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    timer, copy = None, float("nan")
    if not a.tiny:
        env = B.detect_env()
        timer, copy = B.Timer(env), env.copy_gbps
    name = "cpu (interpreter)" if a.tiny else torch.cuda.get_device_name()
    print(f"device {name}  torch {torch.__version__}  triton {triton.__version__}  copy {copy:.0f} GB/s")
    shapes = [(1, 2, 130, 96), (1, 1, 70, 64), (1, 1, 64, 128), (1, 1, 70, 192), (1, 1, 33, 32)] if a.tiny else [(8, 8, 32768, 128)]
    recs = []
    for shp in shapes:
        for sp in [float(s) for s in a.sparsity.split(",")]:
            x = C.random_pruned(*shp, sp, dtype=torch.float16, device=dev, seed=1)
            for kind in ("keys", "values"):
                ref = C.encode_torch(x, kind)
                rd, wr = x.nbytes, ref.nz.nbytes + ref.bitmaps.nbytes + ref.offsets.nbytes
                for vname in a.variants.split(","):
                    try:
                        p1, p2, whole = VARIANTS[vname](x, kind)
                        bad = same(ref, whole())
                        print(f"{'ok  ' if not bad else 'FAIL'} {vname} {kind} {list(shp)} sparsity {sp}" + (f" differs in {bad}" if bad else ""))
                        if bad or a.tiny:
                            continue
                        nz = torch.empty_like(ref.nz)
                        parts = {"whole": (whole, rd, wr)}
                        if p1 is not None:
                            parts["pass1"] = (p1, rd, ref.bitmaps.nbytes + 8 * ref.offsets.numel())
                            parts["pass2"] = (lambda: p2(ref.offsets, nz), rd + ref.offsets.nbytes, ref.nz.nbytes)
                        for part, (fn, r, w) in parts.items():
                            us = timer.time(fn).median_us
                            gbps = (r + w) / us / 1e3
                            print(f"     {vname:18s} {kind:6s} sp {sp} {part:5s} {us:9.1f} µs  {gbps:7.0f} GB/s  {gbps / copy:6.1%} of copy")
                            recs.append(dict(kernel=f"bitmap_compress_{kind}", provider=vname, part=part, device=name, batch=shp[0],
                                             kv_heads=shp[1], seq=shp[2], head_dim=shp[3], sparsity=sp, dtype="float16", median_us=us,
                                             bytes_read=r, bytes_written=w, gbps=gbps, bandwidth_fraction=gbps / copy, copy_gbps=copy))
                    except Exception as e:  # one variant's failure must not stop the others
                        print(f"FAIL {vname} {kind} sparsity {sp}: {type(e).__name__}: {e}")
                        traceback.print_exc(limit=3)
            del x
            if not a.tiny:
                torch.cuda.empty_cache()
    if not a.tiny and "lib" in a.variants.split(","):
        host_gap(recs)
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
