"""GPU try-out: bitmap decode attention variants (expansion walk / popc, num_warps, register caps)
against cuBLAS q·Kᵀ + P·V, Llama-3-8B shapes, fp16. Checks every variant against the torch
reference first. Prints one line per (config, variant); --json PATH writes the records.

    python scripts/try_attn.py [--json out.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.kernels.bitmap_attention import bitmap_attention_reference, bitmap_decode_attention  # noqa: E402
from kvtool.kernels.bitmap_compress import encode_cache  # noqa: E402
from kvtool.bench_suites import prune_per_token  # noqa: E402


def bench(fn):
    import triton.testing
    if os.environ.get("TRITON_INTERPRET") == "1":
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3  # µs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--configs", default="1x32768x0.7,8x32768x0.7,32x32768x0.7,8x32768x0.5,8x4096x0.7")
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    H, HKV, D = (8, 2, 64) if a.tiny else (32, 8, 128)
    configs = [(1, 256, 0.7)] if a.tiny else [tuple(float(x) if "." in x else int(x) for x in c.split("x")) for c in a.configs.split(",")]
    variants = {"popc_w4": dict(expansion="popc", num_warps=4, maxnreg=None), "walk_w4": dict(expansion="walk", num_warps=4, maxnreg=None)}
    for r in ("popc", "walk"):
        for w, mrs in ((4, (168, 128, 96)), (8, (128, 96, 80))):
            for mr in mrs:
                variants[f"{r}_w{w}_r{mr}"] = dict(expansion=r, num_warps=w, maxnreg=mr)
    variants["walk_w4_st2_r128"] = dict(expansion="walk", num_warps=4, num_stages=2, maxnreg=128)
    if a.tiny:  # the interpreter runs the popc path only
        variants = {k: dict(v, expansion="popc") for k, v in variants.items() if k.startswith("popc")}
    recs = []
    if not a.tiny:
        src = torch.empty(2**29, dtype=torch.float16, device=dev)
        dst = torch.empty_like(src)
        copy_us = bench(lambda: dst.copy_(src))
        copy_bw = 2 * src.numel() * 2 / copy_us / 1e3
        print(f"copy 1 GiB: {copy_us:.0f} µs, {copy_bw:.0f} GB/s", flush=True)
        del src, dst
    else:
        copy_bw = float("nan")
    for b, t, sp in configs:
        g = torch.Generator(device=dev).manual_seed(0)
        k = torch.randn(b, HKV, t, D, generator=g, device=dev).half()
        v = torch.randn(b, HKV, t, D, generator=g, device=dev).half()
        q = torch.randn(b, H, 1, D, generator=g, device=dev).half()
        qg = q.view(b, HKV, H // HKV, D)
        scale = 1 / math.sqrt(D)
        base_us = bench(lambda: torch.matmul(torch.matmul(qg, k.transpose(-1, -2)).to(torch.float16), v))
        dense_bytes = 2 * k.numel() * 2
        print(f"b={b} T={t} s={sp}: cublas qk+pv {base_us:.1f} µs ({dense_bytes / base_us / 1e3 / copy_bw:.0%} of copy)", flush=True)
        recs.append(dict(config=[b, t, sp], variant="cublas_qk+pv", median_us=base_us, bytes=dense_bytes))
        w = 32
        cache = encode_cache(prune_per_token(k, sp, w), prune_per_token(v, sp, w), window=w, backend="triton")
        cache.validate()
        nbytes = sum(x.numel() * x.element_size() for x in (cache.keys.nz, cache.keys.bitmaps, cache.keys.offsets, cache.values.nz, cache.values.bitmaps, cache.values.offsets, cache.window_keys, cache.window_values))
        del k, v
        ref_o, ref_l = bitmap_attention_reference(q.float(), type(cache)(*[type(cache.keys)(x.kind, x.nz.float(), x.bitmaps, x.offsets, x.tokens, x.head_dim) for x in (cache.keys, cache.values)], cache.window_keys.float(), cache.window_values.float()), scale) if b * t <= 8 * 32768 else (None, None)
        vs = dict(variants)
        for name, kw in vs.items():
            try:
                fn = lambda kw=kw: bitmap_decode_attention(q, cache, scale, validate=False, **kw)
                o, l = fn()
                rel = float((o - ref_o).norm() / ref_o.norm()) if ref_o is not None else float("nan")
                if ref_o is not None and not rel < 1e-2:
                    print(f"  FAIL {name}: rel {rel:.2e}", flush=True)
                    continue
                us = bench(fn)
                print(f"  {name:12s} {us:8.1f} µs  {base_us / us:5.2f}x cuBLAS  {nbytes / us / 1e3 / copy_bw:5.0%} of copy  rel {rel:.1e}", flush=True)
                recs.append(dict(config=[b, t, sp], variant=name, median_us=us, bytes=nbytes, speedup_cublas=base_us / us, rel=rel))
            except Exception as e:  # keep going
                print(f"  ERROR {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=2)
        del cache, q
        torch.cuda.empty_cache() if dev == "cuda" else None
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_bw, records=recs), indent=1))


if __name__ == "__main__":
    main()
