"""Selective head attention (Polar Sparsity) against dense decode."""

from __future__ import annotations

import torch

from kvtool.bench import harness as B
from kvtool.bench.suites.common import (
    TOL,
    BenchContext,
    dense_records,
    free_memory,
    register_suite,
    require_kernel,
    timed,
)
from kvtool.bench.harness import ModelShape

HEADS_BASELINES = ("torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch", "flashinfer_batch_tc", "heads_all")


def head_choices(shape: ModelShape, batch: int, k: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Head-index tensors ``[B, k]`` int32: ``grouped`` lists whole GQA groups first (the heads of
    ceil(k / G) KV heads, what a group-aware router picks; KV reads scale with k), ``random`` a random
    k of H per sequence (with GQA nearly every KV head keeps a listed head, so reads barely shrink)."""
    g = torch.Generator().manual_seed(seed)
    grouped = []
    random = []
    for _ in range(batch):
        kv_order = torch.randperm(shape.kv_heads, generator=g)
        heads = (kv_order[:, None] * shape.group + torch.arange(shape.group)[None, :]).reshape(-1)
        grouped.append(heads[:k])
        random.append(torch.randperm(shape.heads, generator=g)[:k])
    return {"grouped": torch.stack(grouped).to(device=device, dtype=torch.int32),
            "random": torch.stack(random).to(device=device, dtype=torch.int32)}


@register_suite('heads', ('torch_dense', 'flashinfer_batch', 'heads_all'),
                'Selective head attention at k of H heads vs dense decode.',
                'kvtool bench heads --batch 8 --seq 32k --top-k 16')
def suite_heads(ctx: BenchContext) -> list[dict]:
    """Selective head attention at k of H heads (grouped and random choices) vs dense decode and vs
    the same kernel with every head listed."""
    hm = require_kernel("heads", "heads", ("selective_head_attention", "bytes_read"))
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        if ctx.baselines:
            recs += dense_records(ctx, shape, q, k, v, data, kernel="heads", which=HEADS_BASELINES)
        ref = B.reference_decode(q, k, v, ctx.scale)
        all_idx = torch.arange(shape.heads, device=q.device, dtype=torch.int32).repeat(b, 1)
        ctx.step(f"heads_all b={b} T={t}")
        fn = lambda: hm.selective_head_attention(q, k, v, all_idx, ctx.scale, validate=False)  # noqa: E731
        tm, rel, st = timed(ctx, fn, fn()[0], ref)
        recs.append(B.make_record(ctx.env, "heads", "heads_all", shape, b, t, ctx.dtype, tm, hm.bytes_read(q, k, all_idx),
                                  k=shape.heads, rel=rel, status=st, data=data))
        for kk in ctx.ks:
            for mode, idx in head_choices(shape, b, kk, q.device).items():
                ctx.step(f"heads_{mode} b={b} T={t} k={kk}")
                listed = torch.zeros(b, shape.heads, dtype=torch.bool, device=q.device).scatter_(1, idx.long(), True)
                fn = lambda idx=idx: hm.selective_head_attention(q, k, v, idx, ctx.scale, validate=True)  # noqa: E731
                out = fn()[0]
                # compare the listed heads with the dense reference; unlisted rows must be zero
                unlisted_zero = bool((out[~listed] == 0).all())
                rel = B.rel_err(out[listed], ref[listed])
                ok = unlisted_zero and rel <= TOL.get(ctx.dtype, 1e-2)
                fn = lambda idx=idx: hm.selective_head_attention(q, k, v, idx, ctx.scale, validate=False)  # noqa: E731
                tm = ctx.timer.time(fn) if ok else None
                recs.append(B.make_record(ctx.env, "heads", f"heads_{mode}", shape, b, t, ctx.dtype, tm, hm.bytes_read(q, k, idx),
                                          k=kk, rel=rel, status="ok" if ok else "wrong", data=data))
        del q, k, v, ref
        free_memory(ctx)
    B.add_speedups(recs, list(HEADS_BASELINES))
    return recs
