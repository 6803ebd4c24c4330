"""Sign-VQ LUT scoring variants against the fp16 q·Kᵀ cuBLAS product, on the GPU.

Variants (gqa "sum", the format's default and what ``signvq_decode`` runs; one decode query):
- ``lib``: the library's ``lut_scores_kernel(lookup="gather")`` (table [16, G4] float32, one
  ``tl.gather`` per (token, group)), with a sweep of block_tokens / iters / num_warps;
- ``table``: ``lut_scores_kernel(lookup="table")``: one token per lane, the table written to a
  scratch slot and read back through L1 (all lanes of a warp in one 64-byte row per group);
- ``pair32`` / ``pair16``: one 256-entry table per pair of groups (entry v = lut[v & 15, 2p] +
  lut[v >> 4, 2p + 1], built by a broadcast sum, no gather), one lookup per code byte (half the
  lookups), float32 or float16 table, float32 accumulation;
- ``onehot``: the lookups as an MMA: a one-hot fp16 matrix [BT, 16*G4] (code compares) times the
  table [16*G4, 16] (column 0 the summed query's table, the rest zero).
Every variant is checked against ``kvtool.formats.signvq.lut_scores`` (rel L2 <= 1e-2) on the same
random codes / codebooks, then timed as CUDA-graph replays with L2 flushed (``kvtool.bench.Timer``,
the bench's timer: a plain do_bench here times the Python wrapper's launch overhead) beside torch.matmul of the grouped
fp16 queries [B, Hkv, G, D] with Kᵀ [B, Hkv, D, T], and a 1 GiB copy for the bandwidth fraction.

    python scripts/try_lut.py [--json /tmp/lut.json]      # GPU, from the repo root
    TRITON_INTERPRET=1 python scripts/try_lut.py --tiny   # CPU smoke test of every variant
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.formats.signvq import lut_scores  # noqa: E402
from kvtool.kernels.signvq_lut import lut_scores_kernel  # noqa: E402


# ----------------------------------------------------------------------------- pair table


@triton.jit
def _pair_kernel(q_ptr, codes_ptr, cb_ptr, out_ptr, TC, HKV, sq_b, sq_h, sc_b, sc_h, sc_t, sb_b, sb_h, so_b, so_h,
                 G: tl.constexpr, BP: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr,
                 HALF: tl.constexpr):
    """Sum mode, one query token; codes as int32 words [Tc, BW] (BW * 4 = BP bytes = pairs)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    kh = (pid_bh % HKV).to(tl.int64)
    p = tl.arange(0, BP)
    c = tl.arange(0, 16)
    j = tl.arange(0, 4)
    qs_e = tl.zeros([BP, 4], tl.float32)
    qs_o = tl.zeros([BP, 4], tl.float32)
    for h in tl.static_range(G):
        qb = q_ptr + b * sq_b + (kh * G + h) * sq_h + (p * 8)[:, None] + j[None, :]
        qs_e += tl.load(qb).to(tl.float32)
        qs_o += tl.load(qb + 4).to(tl.float32)
    cbb = cb_ptr + b * sb_b + kh * sb_h + p[None, :, None] * 128 + c[:, None, None] * 4 + j[None, None, :]
    lut_e = tl.sum(tl.load(cbb).to(tl.float32) * qs_e[None, :, :], axis=2)  # [16, BP] even groups
    lut_o = tl.sum(tl.load(cbb + 64).to(tl.float32) * qs_o[None, :, :], axis=2)  # [16, BP] odd groups
    pair = tl.reshape(lut_o[:, None, :] + lut_e[None, :, :], (256, BP))  # row hi * 16 + lo
    if HALF:
        pair = pair.to(tl.float16)
    w = tl.arange(0, BW)
    k4 = tl.arange(0, 4)
    for it in tl.static_range(ITERS):
        t = (pid_t * ITERS + it) * BT + tl.arange(0, BT)
        tmask = t < TC
        words = tl.load(codes_ptr + b * sc_b + kh * sc_h + t[:, None] * sc_t + w[None, :], mask=tmask[:, None], other=0)
        byte = tl.reshape((words[:, :, None] >> (k4 * 8)[None, None, :]) & 255, (BT, BP))
        vals = tl.gather(pair, byte, axis=0).to(tl.float32)
        tl.store(out_ptr + b * so_b + kh * so_h + t, tl.sum(vals, axis=1), mask=tmask)


def pair_scores(q, codes, codebook, half=False, bt=64, iters=16, num_warps=4):
    b, hkv, g4 = codebook.shape[:3]
    h, tc = q.shape[1], codes.shape[2]
    assert g4 % 8 == 0 and q.shape[2] == 1
    codebook = codebook.contiguous()
    src = codes.contiguous().view(torch.int32)
    out = torch.empty(b, hkv, 1, tc, dtype=torch.float32, device=q.device)
    bp = g4 // 2
    bt = min(bt, triton.next_power_of_2(tc))
    iters = max(1, min(iters, triton.cdiv(tc, bt)))
    grid = (triton.cdiv(tc, bt * iters), b * hkv)
    _pair_kernel[grid](q, src, codebook, out, tc, hkv, q.stride(0), q.stride(1), src.stride(0), src.stride(1),
                       src.stride(2), codebook.stride(0), codebook.stride(1), out.stride(0), out.stride(1),
                       G=h // hkv, BP=bp, BW=bp // 4, BT=bt, ITERS=iters, HALF=half, num_warps=num_warps)
    return out


# ----------------------------------------------------------------------------- one-hot MMA


@triton.jit
def _onehot_kernel(q_ptr, codes_ptr, cb_ptr, out_ptr, TC, HKV, sq_b, sq_h, sc_b, sc_h, sc_t, sb_b, sb_h, so_b, so_h,
                   G: tl.constexpr, G4: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr):
    """Sum mode: scores = onehot [BT, G4*16] fp16 @ table [G4*16, 16] fp16 (column 0 = summed table)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    kh = (pid_bh % HKV).to(tl.int64)
    n = tl.arange(0, G4)
    c = tl.arange(0, 16)
    j = tl.arange(0, 4)
    qs = tl.zeros([G4, 4], tl.float32)
    for h in tl.static_range(G):
        qs += tl.load(q_ptr + b * sq_b + (kh * G + h) * sq_h + (n * 4)[:, None] + j[None, :]).to(tl.float32)
    cb = tl.load(cb_ptr + b * sb_b + kh * sb_h + n[:, None, None] * 64 + c[None, :, None] * 4 + j[None, None, :]).to(tl.float32)
    lut = tl.reshape(tl.sum(cb * qs[:, None, :], axis=2), (G4 * 16,))  # row n * 16 + c
    col = tl.arange(0, 16)
    table = tl.where(col[None, :] == 0, lut[:, None], 0.0).to(tl.float16)  # [G4*16, 16]
    w = tl.arange(0, BW)
    k8 = tl.arange(0, 8)
    for it in tl.static_range(ITERS):
        t = (pid_t * ITERS + it) * BT + tl.arange(0, BT)
        tmask = t < TC
        words = tl.load(codes_ptr + b * sc_b + kh * sc_h + t[:, None] * sc_t + w[None, :], mask=tmask[:, None], other=0)
        codes = tl.reshape((words[:, :, None] >> (k8 * 4)[None, None, :]) & 15, (BT, G4))
        hot = tl.reshape((codes[:, :, None] == c[None, None, :]).to(tl.float16), (BT, G4 * 16))
        acc = tl.dot(hot, table)  # [BT, 16] float32
        score = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1)
        tl.store(out_ptr + b * so_b + kh * so_h + t, score, mask=tmask)


def onehot_scores(q, codes, codebook, bt=64, iters=8, num_warps=4):
    b, hkv, g4 = codebook.shape[:3]
    h, tc = q.shape[1], codes.shape[2]
    assert g4 % 8 == 0 and q.shape[2] == 1
    codebook = codebook.contiguous()
    src = codes.contiguous().view(torch.int32)
    out = torch.empty(b, hkv, 1, tc, dtype=torch.float32, device=q.device)
    bt = max(16, min(bt, triton.next_power_of_2(tc)))
    iters = max(1, min(iters, triton.cdiv(tc, bt)))
    grid = (triton.cdiv(tc, bt * iters), b * hkv)
    _onehot_kernel[grid](q, src, codebook, out, tc, hkv, q.stride(0), q.stride(1), src.stride(0), src.stride(1),
                         src.stride(2), codebook.stride(0), codebook.stride(1), out.stride(0), out.stride(1),
                         G=h // hkv, G4=g4, BW=g4 // 8, BT=bt, ITERS=iters, num_warps=num_warps)
    return out


# ----------------------------------------------------------------------------- harness


def variants(tiny: bool):
    v = {}
    sweep = [(64, 16, 4)] if tiny else [(64, 16, 4), (128, 8, 4), (128, 16, 8), (256, 8, 8), (64, 32, 4)]
    for bt, it, nw in sweep:
        v[f"lib_bt{bt}_it{it}_w{nw}"] = lambda q, c, cb, bt=bt, it=it, nw=nw: lut_scores_kernel(q, c, cb, "sum", lookup="gather", block_tokens=bt, iters=it, num_warps=nw)
        for half in (False, True):
            name = f"pair{16 if half else 32}_bt{bt}_it{it}_w{nw}"
            v[name] = lambda q, c, cb, bt=bt, it=it, nw=nw, half=half: pair_scores(q, c, cb, half, bt, it, nw)
    tsweep = [(64, 2, 4)] if tiny else [(128, 16, 4), (256, 8, 4), (256, 16, 4), (512, 8, 4), (256, 8, 8), (512, 8, 8), (512, 4, 4), (1024, 4, 8),
                                        (64, 8, 2), (64, 8, 4), (128, 8, 2), (128, 8, 8), (512, 8, 16), (1024, 8, 16), (2048, 8, 16)]
    for bt, it, nw in tsweep:
        v[f"table_bt{bt}_it{it}_w{nw}"] = lambda q, c, cb, bt=bt, it=it, nw=nw: lut_scores_kernel(q, c, cb, "sum", lookup="table", block_tokens=bt, iters=it, num_warps=nw)
    for bt, it, nw in ([(64, 4, 4)] if tiny else [(64, 8, 4), (128, 8, 4), (128, 8, 8)]):
        v[f"onehot_bt{bt}_it{it}_w{nw}"] = lambda q, c, cb, bt=bt, it=it, nw=nw: onehot_scores(q, c, cb, bt, it, nw)
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny CPU shapes (TRITON_INTERPRET=1 smoke test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="", help="comma-separated variant name prefixes to run (default: all)")
    ap.add_argument("--configs", default="1x32768,8x32768", help="batch x tokens, comma-separated (GPU)")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    h, hkv, d = (8, 2, 64) if args.tiny else (32, 8, 128)
    configs = [(1, 37), (2, 130)] if args.tiny else [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    g4 = d // 4
    from kvtool.bench import Timer, detect_env

    env = detect_env() if not args.tiny else None
    timer = Timer(env, cuda_graph=True) if not args.tiny else None

    def do_bench(fn, warmup=25, rep=100):  # milliseconds, like triton.testing.do_bench
        return timer.time(fn).median_us / 1e3

    copy_bw = None
    if not args.tiny:
        copy_bw = env.copy_gbps * 1e9
        print(f"device {torch.cuda.get_device_name()} copy {copy_bw / 1e12:.2f} TB/s; torch {torch.__version__} triton {triton.__version__}")
    recs = []
    for b, t in configs:
        gen = torch.Generator(device="cpu").manual_seed(b * 7 + t)
        q = torch.randn(b, h, 1, d, generator=gen).to(dev, torch.float16)
        codes = torch.randint(0, 256, (b, hkv, t, g4 // 2), generator=gen, dtype=torch.uint8).to(dev)
        book = torch.randn(b, hkv, g4, 16, 4, generator=gen).to(dev, torch.float16)
        ref = lut_scores(q, codes, book, "sum")
        nbytes = codes.nbytes + book.nbytes + q.nbytes
        shape = f"b{b} T{t} H{h}/{hkv} D{d}"
        base_us = None
        if not args.tiny:
            keys = torch.randn(b, hkv, t, d, device=dev, dtype=torch.float16)
            qg = q.reshape(b, hkv, h // hkv, d)
            kt = keys.transpose(-1, -2)
            base_us = do_bench(lambda: torch.matmul(qg, kt), warmup=25, rep=100) * 1e3
            bb = keys.nbytes + q.nbytes
            print(f"{'cublas_qk':28s} {shape}  {base_us:8.1f} us  {bb / base_us / 1e3:7.1f} GB/s  {bb / base_us * 1e6 / copy_bw:5.1%}")
            recs.append(dict(variant="cublas_qk", batch=b, seq=t, median_us=base_us, bytes_read=bb, bandwidth_fraction=bb / base_us * 1e6 / copy_bw))
            del keys, kt
        only = tuple(p for p in args.only.split(",") if p)
        for name, fn in variants(args.tiny).items():
            if only and not name.startswith(only):
                continue
            try:
                out = fn(q, codes, book)
                rel = float((out.double() - ref.double()).norm() / ref.double().norm())
                ok = rel <= 1e-2
                us = do_bench(lambda: fn(q, codes, book), warmup=25, rep=100) * 1e3 if not args.tiny else float("nan")
                frac = nbytes / us * 1e6 / copy_bw if copy_bw else float("nan")
                sp = base_us / us if base_us else float("nan")
                print(f"{'ok  ' if ok else 'FAIL'} {name:28s} {shape}  rel {rel:.1e}  {us:8.1f} us  {nbytes / us / 1e3:7.1f} GB/s  {frac:5.1%}  {sp:5.2f}x cublas")
                recs.append(dict(variant=name, batch=b, seq=t, ok=ok, rel=rel, median_us=us, bytes_read=nbytes,
                                 bandwidth_fraction=frac, speedup_cublas=sp))
            except Exception as exc:  # one variant's failure must not stop the others
                print(f"FAIL {name} {shape}: {type(exc).__name__}: {exc}")
                traceback.print_exc(limit=2)
                recs.append(dict(variant=name, batch=b, seq=t, ok=False, error=f"{type(exc).__name__}: {exc}"))
    if args.json:
        Path(args.json).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
