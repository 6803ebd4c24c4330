"""GPU try-out: selective head attention launch settings at Llama-3-8B shapes, fp16, k = 16 of 32
heads as whole GQA groups, against torch SDPA on all heads (the dense decode the bench compares
with, besides FlashInfer), timed as CUDA-graph replays with L2 flushed. ``default`` is the library's
split rule (on all B * Hkv groups); ``splits_x{f}`` are f times the same rule on the KV-head groups
that are surely active (B * ceil(k / G)), alone and with 128-token steps and one stage. Checks
each setting against the torch reference first. --json PATH writes the records; --tiny runs on the CPU
interpreter.

    python scripts/try_heads.py [--json out.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.bench import model_shape  # noqa: E402
from kvtool.bench_suites import head_choices  # noqa: E402
from kvtool.kernels.heads import selective_head_attention, selective_head_attention_reference  # noqa: E402


TIMER = None


def bench(fn):
    """Median µs of CUDA-graph replays with L2 flushed (the bench's timer); NaN on the interpreter."""
    global TIMER
    if os.environ.get("TRITON_INTERPRET") == "1":
        fn()
        return float("nan")
    if TIMER is None:
        from kvtool.bench import Timer, detect_env
        TIMER = Timer(detect_env(measure_copy=False), cuda_graph=True)
    return TIMER.time(fn).median_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--configs", default="", help="batch x tokens list, e.g. 8x4096,32x4096 (default: five configurations)")
    ap.add_argument("--grid", action="store_true", help="sweep warps / tokens per step / stages instead of the splits")
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    shape = model_shape("smollm2" if a.tiny else "llama3-8b")
    configs = [(1, 128)] if a.tiny else [(1, 4096), (8, 4096), (32, 4096), (1, 32768), (8, 32768)]
    if a.configs:
        configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")]
    settings = {"default": {}}
    if a.grid and not a.tiny:
        for w in (4, 8):
            for bn in (32, 64, 128):
                for st in (1, 2, 3, 4):
                    settings[f"w{w}_bn{bn}_st{st}"] = dict(num_warps=w, block_n=bn, num_stages=st)
    elif not a.tiny:
        for f in (0.5, 0.75, 1, 1.5, 2, 3):
            settings[f"splits_x{f}"] = {"split_factor": f}
            settings[f"bn128_st1_splits_x{f}"] = {"split_factor": f, "block_n": 128, "num_stages": 1}
    recs = []
    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    for b, n in configs:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, h, d, generator=g, device=dev).half()
        k = torch.randn(b, hkv, n, d, generator=g, device=dev).half()
        v = torch.randn(b, hkv, n, d, generator=g, device=dev).half()
        idx = head_choices(shape, b, h // 2, dev)["grouped"]
        ref, _ = selective_head_attention_reference(q.float(), k.float(), v.float(), idx)
        rows = torch.zeros(b, h, dtype=torch.bool, device=dev)
        rows.scatter_(1, idx.long(), True)
        sdpa_us = bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
        print(f"b={b} n={n}: sdpa (all heads) {sdpa_us:.1f} µs", flush=True)
        recs.append(dict(config=[b, n], setting="sdpa_all_heads", median_us=sdpa_us))
        from kvtool.kernels.heads import default_splits
        for name, kw in settings.items():
            kw = dict(kw)
            if "split_factor" in kw:
                f = kw.pop("split_factor")
                kw["num_splits"] = max(1, round(default_splits(b * min(hkv, -(-(h // 2) // (h // hkv))), n, q.device) * f))
            try:
                fn = lambda kw=kw: selective_head_attention(q, k, v, idx, validate=False, **kw)
                out, _ = fn()
                rel = float((out[rows] - ref[rows]).norm() / ref[rows].norm())
                if not rel < 1e-2:
                    print(f"  FAIL {name}: rel {rel:.2e}", flush=True)
                    continue
                us = bench(fn)
                print(f"  {name:22s} {us:8.1f} µs  {sdpa_us / us:5.2f}x sdpa  rel {rel:.1e}", flush=True)
                recs.append(dict(config=[b, n], setting=name, median_us=us, speedup_sdpa=sdpa_us / us, rel=rel))
            except Exception as e:
                print(f"  ERROR {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
