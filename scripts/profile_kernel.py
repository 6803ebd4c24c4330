"""Run one kernel once at a given shape (for ncu): python scripts/profile_kernel.py KERNEL BATCH SEQ [PARAM].

KERNEL: attention (PARAM = sparsity), heads (PARAM = k, grouped choice), compress (PARAM = sparsity).
Llama-3-8B attention shape (32 heads, 8 KV heads, head_dim 128), fp16, random data."""

from __future__ import annotations

import sys

import torch

from kvtool import bench as B
from kvtool import bench_suites as S


def main() -> None:
    kernel, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    param = float(sys.argv[4]) if len(sys.argv) > 4 else None
    shape = B.model_shape("llama3-8b")
    q, k, v = B.random_decode_inputs(shape, batch, seq, torch.float16, "cuda")
    if kernel == "attention":
        from kvtool.kernels import bitmap_attention, bitmap_compress

        sp = 0.7 if param is None else param
        cache = bitmap_compress.encode_cache(S.prune_per_token(k, sp, 32), S.prune_per_token(v, sp, 32), window=32, backend="triton")
        fn = lambda: bitmap_attention.bitmap_decode_attention(q[:, :, None], cache, validate=False)  # noqa: E731
    elif kernel == "attention_popc":
        from kvtool.kernels import bitmap_attention_popc, bitmap_compress

        sp = 0.7 if param is None else param
        cache = bitmap_compress.encode_cache(S.prune_per_token(k, sp, 32), S.prune_per_token(v, sp, 32), window=32, backend="triton")
        fn = lambda: bitmap_attention_popc.bitmap_decode_attention_popc(q[:, :, None], cache, validate=False)  # noqa: E731
    elif kernel == "heads":
        from kvtool.kernels import heads

        idx = S.head_choices(shape, batch, int(param or 16), "cuda")["grouped"]
        fn = lambda: heads.selective_head_attention(q, k, v, idx, validate=False)  # noqa: E731
    elif kernel == "compress":
        from kvtool.kernels import bitmap_compress

        x = S.prune_per_token(k, 0.7 if param is None else param)
        fn = lambda: bitmap_compress.encode_triton(x, "keys")  # noqa: E731
    else:
        raise SystemExit(f"unknown kernel {kernel}")
    fn()
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
