"""Run one kernel once at a given shape (for ncu): python scripts/profile_kernel.py KERNEL BATCH SEQ [PARAM].

KERNEL: kivi (the KIVI decode kernel, PARAM = bits, a 5th argument the group), attention (layout-v2 bitmap attention, PARAM = sparsity; a 5th argument ``fp16`` for fp16
per-word sums, ``scalar`` / ``tensor_cores`` to force a walk), heads (PARAM = k, grouped choice), compress /
compress_values (keys / values, PARAM = sparsity; launches: pass 1, pass 2, pass 1, pass 2),
prune_encode / prune_encode_values (the one-launch CUDA prune + encode of the layout-v2 keys /
values, PARAM = sparsity), signvq / pages (PARAM = budget; a 5th argument ``breakdown`` prints a
torch.profiler table of 10 calls instead of running twice for ncu).
Llama-3-8B attention shape (32 heads, 8 KV heads, head_dim 128), fp16, random data."""

from __future__ import annotations

import sys

import torch

from kvtool.bench import harness as B
from kvtool.bench.suites.bitmap import prune_per_token
from kvtool.bench.suites.heads import head_choices
from kvtool.formats.pagestat import make_pagestat_inputs, pagestat_decode
from kvtool.formats.signvq import make_signvq_inputs, signvq_decode
from kvtool.kernels import bitmap_compress, bitmap_prune_encode, bitmap_sparse_attention, heads
from kvtool.methods.prune import keep_count


def main() -> None:
    kernel, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    param = float(sys.argv[4]) if len(sys.argv) > 4 else None
    shape = B.model_shape("llama3-8b")
    q, k, v = B.random_decode_inputs(shape, batch, seq, torch.float16, "cuda")
    if kernel == "attention":
        sp = 0.7 if param is None else param
        cache = bitmap_sparse_attention.encode_cache_v2(prune_per_token(k, sp, 32), prune_per_token(v, sp, 32), window=32, backend="triton")
        acc = "fp16" if "fp16" in sys.argv[5:] else "fp32"
        tc = True if "tensor_cores" in sys.argv[5:] else False if "scalar" in sys.argv[5:] else None
        fn = lambda: bitmap_sparse_attention._tuned_attention(q[:, :, None], cache, accumulate=acc, tensor_cores=tc)  # noqa: E731
    elif kernel == "heads":
        idx = head_choices(shape, batch, int(param or 16), "cuda")["grouped"]
        fn = lambda: heads.selective_head_attention(q, k, v, idx, validate=False)  # noqa: E731
    elif kernel in ("compress", "compress_values"):
        x = prune_per_token(k if kernel == "compress" else v, 0.7 if param is None else param)
        fn = lambda: bitmap_compress.encode_triton(x, "keys" if kernel == "compress" else "values")  # noqa: E731
    elif kernel in ("prune_encode", "prune_encode_values"):
        keep = keep_count(128, 0.7 if param is None else param)
        x, kind = (k, "values") if kernel == "prune_encode" else (v, "keys")  # layout v2 orientations
        fn = lambda: bitmap_prune_encode.prune_encode(x, kind, keep, backend="cuda")  # noqa: E731
    elif kernel == "kivi":  # PARAM = bits; a 5th argument: the group (default 32; residual 32, or 0 from group 128)
        from kvtool.core.cache import LayerKV
        from kvtool.formats.quant import QuantFormat, QuantParams
        from kvtool.kernels.kivi_attention import cache_from_encoded, kivi_attention

        group = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5].isdigit() else 32
        enc = QuantFormat().encode(LayerKV(k, v), QuantParams(bits=int(param or 4), group=group, residual=0 if group >= 128 else 32))
        cache = cache_from_encoded(enc)
        del enc
        q4 = q[:, :, None]
        fn = lambda: kivi_attention(q4, cache)  # noqa: E731
    elif kernel == "signvq":
        q4, enc = make_signvq_inputs(batch, 32, 8, seq, 128, device="cuda", budget=int(param or 2048))
        fn = lambda: signvq_decode(q4, enc)  # noqa: E731
    elif kernel == "pages":
        q4, enc = make_pagestat_inputs(batch, 32, 8, seq, 128, device="cuda", budget=int(param or 2048))
        fn = lambda: pagestat_decode(q4, enc)  # noqa: E731
    else:
        raise SystemExit(f"unknown kernel {kernel}")
    fn()
    torch.cuda.synchronize()
    if "breakdown" in sys.argv[5:]:
        # where the time of one call goes: GPU kernels and host-side ops, 10 calls
        from torch.profiler import ProfilerActivity, profile

        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"== {kernel} b={batch} T={seq} param={param}: 10 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        return
    fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
