"""GPU try-out: token-axis splits of the bitmap decode attention now that the merge reads 32 splits
per vector load; with --batch1, launch settings at batch 1 (expansion, register cap, warps, stages,
splits). Llama-3-8B shapes, fp16, 70% per-token magnitude pruning, window 32; CUDA-graph
replays with L2 flushed (the bench's timer); each setting checked against the torch reference.

    python scripts/try_bitmap_splits.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool import bench as B  # noqa: E402
from kvtool import bench_suites as S  # noqa: E402
from kvtool.kernels import bitmap_attention as A, bitmap_compress as C  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--batch1", action="store_true")
    a = ap.parse_args()
    timer = B.Timer(B.detect_env(measure_copy=False), cuda_graph=True)
    shape = B.model_shape("llama3-8b")
    recs = []
    configs = ((1, 4096), (1, 32768)) if a.batch1 else ((1, 4096), (1, 32768), (8, 4096), (8, 32768))
    for b, n in configs:
        q, k, v = B.random_decode_inputs(shape, b, n, torch.float16, "cuda")
        kp, vp = S.prune_per_token(k, 0.7, 32), S.prune_per_token(v, 0.7, 32)
        cache = C.encode_cache(kp, vp, window=32, backend="triton")
        q4 = q[:, :, None]
        ref = B.reference_decode(q, kp, vp, 128 ** -0.5)
        base = A.default_splits(b * shape.kv_heads, cache.keys.blocks, q.device)
        if a.batch1:
            settings = [dict(f=f, expansion=e, maxnreg=r, num_warps=w, num_stages=st)
                        for f in (0.75, 1, 1.5) for e, r in (("walk", 128), ("popc", None), ("popc", 128))
                        for w, st in ((4, 1), (4, 2), (8, 1))]
        else:
            settings = [dict(f=f) for f in (0.5, 1, 2, 4, 8)]
        for st in settings:
            kw = dict(st)
            f = kw.pop("f")
            splits = max(1, round(base * f))
            fn = lambda splits=splits, kw=kw: A.bitmap_decode_attention(q4, cache, num_splits=splits, validate=False, **kw)  # noqa: E731
            out, _ = fn()
            rel = B.rel_err(out[:, :, 0], ref)
            us = timer.time(fn).median_us
            print(f"b{b} T{n} splits {splits:4d} (x{f}) {kw} {us:8.1f} us rel {rel:.1e}", flush=True)
            recs.append(dict(batch=b, seq=n, splits=splits, factor=f, **kw, median_us=us, rel=rel))
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
