"""Time the Triton bitmap encoder's variants on the GPU (lead runs this on an H100).

Shape: batch 8, 8 KV heads, 32768 tokens, head_dim 128, fp16, pruned per token by magnitude
(``random_pruned``) at 50% and 70% sparsity; keys and values. Every variant's bytes (nz, bitmaps,
offsets) are checked with torch.equal against ``encode_torch`` first; then each variant is timed
whole (both passes, the host sync for ``len(nz)``, allocations) and per pass with
``triton.testing.do_bench(warmup=25, rep=100)`` (L2 flushed). Bytes = read + written, like a copy;
fraction = GB/s over a ``dst.copy_(src)`` of a 1 GiB fp16 tensor measured here.

Variants: ``old`` (the encoder before the second round, copied below: [channels, 64 tokens] key
tiles, per-element popcounts), ``scan_w{4,8,16}`` (the library kernel: token-major loads, exclusive
scans, scattered stores; num_warps 4/8/16), ``sort_w{4,8}`` (values packed by a per-token sort and
contiguous stores; keys as scan; removed in the fourth session with the sort itself, JSON in
docs/benchmarks/try_compress_sort_h100.json), ``*_r128`` (pass 2 capped at 128 registers). The
library kernel's variants now run its current code (scripts/try_compress2.py times its layouts). Two more settings
were timed in the second round and removed after it (JSON in docs/benchmarks/try_compress_h100.json):
keys stored from the transposed tile (slower) and 2-4 blocks per program (no faster).

    python scripts/try_compress.py [--json PATH]          # from the repo root, CUDA
    TRITON_INTERPRET=1 python scripts/try_compress.py --tiny   # CPU smoke test of every variant
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

from kvtool.kernels import bitmap_compress as C  # noqa: E402
from kvtool.kernels.bitmap_layout import _INT_VIEW, TILE, align_elements  # noqa: E402


@triton.jit
def _old_kernel(
    x_ptr,  # int view of the dense tensor [B*Hkv, Tc, D]
    bitmap_ptr,  # int32 view of the bitmaps: keys [B*Hkv, NB, D, 2]; values [B*Hkv, Tc, DT, 2]
    count_ptr,  # int64 [B*Hkv*NB] (pass 1 writes)
    offset_ptr,  # int64 [B*Hkv*NB + 1] (pass 2 reads)
    nz_ptr,  # int view [total] (pass 2 writes)
    Tc,
    D,
    NB,
    DT,
    IS_KEY: tl.constexpr,
    DP: tl.constexpr,  # power of two >= max(D, 64)
    WRITE: tl.constexpr,  # False: pass 1 (bitmaps, counts); True: pass 2 (non-zeros)
    USE_ASM: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    bh = g // NB
    blk = g % NB
    t = tl.arange(0, 64)
    c = tl.arange(0, DP)
    i32 = tl.arange(0, 32)
    tok = blk * 64 + t
    base = x_ptr + bh * Tc * D
    # The block as [rows, columns] in storage order, columns cut into 32-bit half-words:
    # keys rows = channels, columns = 64 tokens (2 half-words); values rows = tokens, columns = DP
    # channels (DP / 32 half-words, two per 64-channel tile).
    if IS_KEY:
        m = (c[:, None] < D) & (tok[None, :] < Tc)
        raw = tl.load(base + tok[None, :] * D + c[:, None], mask=m, other=0)  # [DP, 64]
        bits = tl.reshape((raw != 0).to(tl.int32), (DP, 2, 32))
    else:
        m = (tok[:, None] < Tc) & (c[None, :] < D)
        raw = tl.load(base + tok[:, None] * D + c[None, :], mask=m, other=0)  # [64, DP]
        bits = tl.reshape((raw != 0).to(tl.int32), (64, DP // 32, 32))
    words = tl.sum(bits << i32[None, None, :], axis=2)  # half-words (distinct bits: no overflow)
    pc = C._popc32(words, USE_ASM)
    if not WRITE:
        if IS_KEY:
            h = tl.arange(0, 2)
            tl.store(bitmap_ptr + (g * D + c[:, None]) * 2 + h[None, :], words, mask=(c[:, None] < D) & (h[None, :] < 2))
        else:
            p = tl.arange(0, DP // 32)
            wmask = (tok[:, None] < Tc) & (p[None, :] < 2 * DT)
            tl.store(bitmap_ptr + (bh * Tc + tok[:, None]) * (2 * DT) + p[None, :], words, mask=wmask)
        tl.store(count_ptr + g, tl.sum(tl.sum(pc, axis=1), axis=0).to(tl.int64))
    else:
        start = tl.load(offset_ptr + g)
        row = tl.sum(pc, axis=1)
        row_off = tl.cumsum(row, axis=0) - row
        piece_off = tl.cumsum(pc, axis=1) - pc
        below = ((tl.full([32], 1, tl.int32) << i32) - 1)[None, None, :]
        pos3 = row_off[:, None, None] + piece_off[:, :, None] + C._popc32(words[:, :, None] & below, USE_ASM)
        if IS_KEY:
            pos = tl.reshape(pos3, (DP, 64))
        else:
            pos = tl.reshape(pos3, (64, DP))
        tl.store(nz_ptr + start + pos.to(tl.int64), raw, mask=raw != 0)


def _setup(x, kind):
    b, h, tc, d = x.shape
    nb = -(-tc // TILE)
    dt = -(-d // TILE)
    shape = (b, h, nb, d) if kind == "keys" else (b, h, tc, dt)
    bitmaps = torch.zeros(shape, dtype=torch.int64, device=x.device)
    counts = torch.zeros(b * h * nb, dtype=torch.int64, device=x.device)
    return nb, dt, bitmaps, counts


def old_passes(x, kind, warps=None):
    """(pass1, pass2_given_offsets, whole) closures for the old encoder."""
    b, h, tc, d = x.shape
    nb, dt, bitmaps, counts = _setup(x, kind)
    xi = x.view(_INT_VIEW[x.dtype])
    dp = C._dp(d)
    asm = x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    args = dict(IS_KEY=kind == "keys", DP=dp, USE_ASM=asm, num_warps=warps or min(16, max(4, dp // 16)))
    bm32 = bitmaps.view(torch.int32)
    grid = (b * h * nb,)

    def p1():
        _old_kernel[grid](xi, bm32, counts, counts, xi, tc, d, nb, dt, WRITE=False, **args)

    def p2(offsets, nz):
        _old_kernel[grid](xi, bm32, counts, offsets, nz.view(_INT_VIEW[x.dtype]), tc, d, nb, dt, WRITE=True, **args)

    def whole():
        p1()
        offsets = C._offsets(counts, align_elements(x.dtype))
        nz = torch.zeros(int(offsets[-1]), dtype=x.dtype, device=x.device)
        p2(offsets, nz)
        return C.BitmapTensor(kind, nz, bitmaps, offsets, tc, d)

    return p1, p2, whole


def scan_passes(warps=None, maxnreg=None):
    """(pass1, pass2_given_offsets, whole) closures for the library kernel with these settings."""
    def make(x, kind):
        b, h, tc, d = x.shape
        nb, dt, bitmaps, _ = _setup(x, kind)
        counts = torch.zeros(b * h * nb + 1, dtype=torch.int64, device=x.device)  # the library's pass 1 writes 0, then the counts
        xi = x.view(_INT_VIEW[x.dtype])
        args = dict(IS_KEY=kind == "keys", DP=C._dp(d), num_warps=warps or 4, USE_ASM=x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
        bm32 = bitmaps.view(torch.int32)
        grid = (b * h * nb,)
        extra = {"maxnreg": maxnreg} if maxnreg and x.is_cuda else {}

        def p1():
            C._bitmap_compress_kernel[grid](xi, bm32, counts, xi, tc, d, nb, WRITE=False, **args)

        def p2(offsets, nz):
            C._bitmap_compress_kernel[grid](xi, bm32, offsets, nz.view(_INT_VIEW[x.dtype]), tc, d, nb, WRITE=True, **args, **extra)

        def whole():
            return C._encode_triton(x, kind, num_warps=warps, maxnreg=maxnreg)

        return p1, p2, whole

    return make


VARIANTS = {
    "old": old_passes,
    "scan_w4": scan_passes(4),
    "scan_w8": scan_passes(8),
    "scan_w16": scan_passes(16),
    "scan_w4_r128": scan_passes(4, maxnreg=128),
}


def same(a, b):
    bad = [n for n in ("nz", "bitmaps", "offsets") if not torch.equal(getattr(a, n).view(-1).view(torch.uint8) if n == "nz" else getattr(a, n), getattr(b, n).view(-1).view(torch.uint8) if n == "nz" else getattr(b, n))]
    return bad


def bench(fn, tiny):
    if tiny:
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3  # µs


def copy_gbps(tiny):
    if tiny:
        return float("nan")
    src = torch.empty(2**29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100) * 1e3
    return 2 * src.nbytes / us / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny CPU shapes (use TRITON_INTERPRET=1): checks only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    shape = (1, 2, 130, 96) if a.tiny else (8, 8, 32768, 128)
    copy = copy_gbps(a.tiny)
    name = "cpu (interpreter)" if a.tiny else torch.cuda.get_device_name()
    print(f"device {name}  torch {torch.__version__}  triton {triton.__version__}  copy {copy:.0f} GB/s")
    recs = []
    shapes = [shape, (1, 1, 70, 64)] if a.tiny else [shape]
    for shp in shapes:
        for sp in (0.5, 0.7):
            x = C.random_pruned(*shp, sp, dtype=torch.float16, device=dev, seed=1)
            for kind in ("keys", "values"):
                ref = C.encode_torch(x, kind)
                moved_rd = x.nbytes
                moved_wr = ref.nz.nbytes + ref.bitmaps.nbytes + ref.offsets.nbytes
                for vname in a.variants.split(","):
                    try:
                        p1, p2, whole = VARIANTS[vname](x, kind)
                        got = whole()
                        bad = same(ref, got)
                        print(f"{'ok  ' if not bad else 'FAIL'} {vname} {kind} {list(shp)} sparsity {sp}" + (f" differs in {bad}" if bad else ""))
                        if bad:
                            continue
                        nz = torch.empty_like(ref.nz)
                        parts = {
                            "whole": (whole, moved_rd, moved_wr),
                            "pass1": (p1, moved_rd, ref.bitmaps.nbytes + ref.offsets.nbytes),
                            "pass2": (lambda: p2(ref.offsets, nz), moved_rd + ref.offsets.nbytes, ref.nz.nbytes),
                        }
                        for part, (fn, rd, wr) in parts.items():
                            us = bench(fn, a.tiny)
                            gbps = (rd + wr) / us / 1e3
                            frac = gbps / copy
                            print(f"     {vname:16s} {kind:6s} sp {sp} {part:5s} {us:9.1f} µs  read {rd / 1e6:7.1f} MB  written {wr / 1e6:7.1f} MB  {gbps:7.0f} GB/s  {frac:6.1%} of copy")
                            recs.append(dict(kernel=f"bitmap_compress_{kind}", provider=vname, part=part, device=name, batch=shp[0],
                                             kv_heads=shp[1], seq=shp[2], head_dim=shp[3], sparsity=sp, dtype="float16", median_us=us,
                                             bytes_read=rd, bytes_written=wr, gbps=gbps, bandwidth_fraction=frac, copy_gbps=copy))
                    except Exception as e:  # one variant's failure must not stop the others
                        print(f"FAIL {vname} {kind} sparsity {sp}: {type(e).__name__}: {e}")
                        traceback.print_exc(limit=3)
            del x
            if not a.tiny:
                torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
