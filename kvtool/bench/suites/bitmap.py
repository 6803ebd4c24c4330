"""The bitmap (Mustafar) kernels: whole decode attention, the two SpMV halves, compression."""

from __future__ import annotations

import torch

from kvtool.bench import harness as B
from kvtool.bench.suites.common import (
    BenchContext,
    dense_records,
    free_memory,
    register_suite,
    require_kernel,
    speedups_per_kernel,
    timed,
)
from kvtool.bench.suites.retrieval import retrieval_encode_records
from kvtool.core.selection import keep_count, magnitude_keep

def prune_per_token(x: torch.Tensor, sparsity: float, window: int = 0) -> torch.Tensor:
    """Per-token magnitude pruning (Mustafar's default, :func:`kvtool.methods.prune.per_token_mask`'s
    rule): each token of ``x`` ``[B, Hkv, T, D]`` keeps its ``keep_count(D, sparsity)`` largest |x|
    (ties to the lower channel); the last ``window`` tokens stay dense. Returns a new tensor
    (pruned elements +0.0)."""
    out = x.clone()
    tc = x.shape[2] - window
    if tc > 0:
        part = out[:, :, :tc]
        part.masked_fill_(~magnitude_keep(part, keep_count(x.shape[-1], sparsity)), 0)
    return out


ATTENTION_BASELINES = ("cublas_qk+pv", "sdpa", "flashinfer_batch", "flashinfer_batch_tc")


def _bitmap_bytes(cache) -> int:
    kb, vb = cache.keys, cache.values
    return B.tensor_bytes(kb.nz, kb.bitmaps, kb.offsets, vb.nz, vb.bitmaps, vb.offsets, cache.window_keys, cache.window_values)


@register_suite('attention', (B.BEST_DENSE, 'sdpa', 'flashinfer_batch', 'flashinfer_batch_tc', 'cublas_qk+pv'),
                'Whole decode attention: bitmap sparse attention vs dense cuBLAS, SDPA and FlashInfer decode.',
                'kvtool bench attention --batch 1,8,32 --seq 4k,32k --sparsity 0.5,0.7 -o att.json --plot-output att.png')
def suite_attention(ctx: BenchContext) -> list[dict]:
    """Bitmap sparse decode attention (keys and values pruned per token to each sparsity, the last
    ``window`` tokens dense; layout v2, :mod:`kvtool.kernels.bitmap_sparse_attention` with
    ``ctx.backend``) vs the dense baselines on the unpruned tensors of the same shape: ``bitmap`` is
    the plain call ``bitmap_sparse_attention(q, cache, scale)`` as a user makes it (the backend that
    ran in ``backend``); on the cuda backend at head_dim 64 and 128 also the walk it did not choose
    (``bitmap_tensor_cores`` or ``bitmap_scalar``, through the benchmarks' knobs). Speedups are
    taken against every baseline and against the best of them in the same run (``best_dense``)."""
    att = require_kernel("bitmap_sparse_attention", "attention", ("bitmap_sparse_attention", "_tuned_attention", "encode_cache_v2",
                                                                   "prepare_attention", "pick_backend", "use_tensor_cores"))
    backend = "triton" if ctx.env.device_type == "cuda" else "torch"
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        if ctx.baselines:
            recs += dense_records(ctx, shape, q, k, v, data, kernel="bitmap_attention", which=ATTENTION_BASELINES)
        q4 = q[:, :, None]
        for sp in ctx.sparsities:
            ctx.step(f"bitmap_attention b={b} T={t} sparsity={sp}")
            kp, vp = prune_per_token(k, sp, ctx.window), prune_per_token(v, sp, ctx.window)
            cache = att.encode_cache_v2(kp, vp, window=min(ctx.window, t), backend=backend)
            att.prepare_attention(cache)  # what the first call does: checks and plan, outside the timing
            which = att.pick_backend(q, ctx.backend)
            ref = B.reference_decode(q, kp, vp, ctx.scale)
            del kp, vp
            runs = [("bitmap", None)]
            if which == "cuda" and shape.head_dim in (64, 128):
                mma = att.use_tensor_cores(cache.plan.kcap, cache.plan.vcap, shape.head_dim, launch_pairs=b * shape.kv_heads * -(-cache.keys.blocks // 2))
                runs.append(("bitmap_scalar", dict(tensor_cores=False)) if mma else ("bitmap_tensor_cores", dict(tensor_cores=True)))
            for provider, knobs in runs:
                ctx.step(f"{provider} b={b} T={t} sparsity={sp}")
                if knobs is None:
                    fn = lambda cache=cache, which=which: att.bitmap_sparse_attention(q4, cache, ctx.scale, backend=which)  # noqa: E731
                else:
                    fn = lambda cache=cache, which=which, knobs=knobs: att._tuned_attention(q4, cache, ctx.scale, backend=which, **knobs)  # noqa: E731
                tm, rel, st = timed(ctx, fn, fn()[0], ref)
                recs.append(B.make_record(ctx.env, "bitmap_attention", provider, shape, b, t, ctx.dtype, tm,
                                          _bitmap_bytes(cache) + B.tensor_bytes(q), sparsity=sp, rel=rel, status=st, data=data,
                                          backend=which))
            del cache, ref
            free_memory(ctx)
        del q, k, v, q4
        free_memory(ctx)
    B.add_speedups(recs, list(ATTENTION_BASELINES) + [B.BEST_DENSE])
    return recs


@register_suite('compress', ('bitmap_torch',),
                'Throughput of bitmap compression (encode of pruned tensors; one-launch prune + encode) and sign-VQ / page-statistics encoding vs copy bandwidth.',
                'kvtool bench compress --batch 8 --seq 32k --sparsity 0.7')
def suite_compress(ctx: BenchContext) -> list[dict]:
    """Bitmap compression throughput: the Triton encoder vs the torch encoder on the same pruned keys
    and values, and the one-launch prune + encode (CUDA) vs torch pruning + encoding on the dense
    ones (bytes = dense input read + layout written; ``bandwidth_fraction`` against copy, which
    also counts read + write). The outputs must be byte-identical."""
    comp = require_kernel("bitmap_compress", "compress", ("encode_torch", "encode_triton"))
    fused = require_kernel("bitmap_prune_encode", "compress", ("prune_encode", "prune_encode_reference"))
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        del q
        for sp in ctx.sparsities:
            # layout v2 orientations: keys as token tiles, values as channel tiles
            for name, kind, raw in (("keys", "values", k), ("values", "keys", v)):
                ctx.step(f"bitmap compress {name} b={b} T={t} sparsity={sp}")
                x = prune_per_token(raw, sp)
                ref = comp.encode_torch(x, kind)
                moved = B.tensor_bytes(x) + B.tensor_bytes(ref.nz, ref.bitmaps, ref.offsets)
                got = comp.encode_triton(x, kind) if ctx.env.device_type == "cuda" or B.interpret_mode() else None
                same = got is not None and got.same_bytes(ref)
                tm = ctx.timer.time(lambda: comp.encode_triton(x, kind)) if same else None
                recs.append(B.make_record(ctx.env, f"bitmap_compress_{name}", "bitmap_triton", shape, b, t, ctx.dtype, tm, moved,
                                          sparsity=sp, rel=0.0 if same else None, status="ok" if same else "wrong", data=data))
                tm = ctx.timer.time(lambda: comp.encode_torch(x, kind))
                recs.append(B.make_record(ctx.env, f"bitmap_compress_{name}", "bitmap_torch", shape, b, t, ctx.dtype, tm, moved,
                                          sparsity=sp, rel=0.0, data=data))
                recs += _prune_encode_records(ctx, fused, shape, b, t, name, kind, raw, sp, ref, moved, data)
                del x, ref, got
                free_memory(ctx)
        recs += retrieval_encode_records(ctx, shape, b, t, k, v, data)
        del k, v
        free_memory(ctx)
    speedups_per_kernel(recs, ["bitmap_torch"])
    return recs


def _prune_encode_records(ctx: BenchContext, fused, shape, b: int, t: int, name: str, kind: str, raw: torch.Tensor, sp: float, ref, moved: int, data: str) -> list[dict]:
    """The one-launch prune + encode (``bitmap_cuda``, CUDA GPUs only) and its torch reference
    (``bitmap_torch``: sort-based pruning, then the torch encoder) on the dense ``raw`` tensor;
    ``ref`` is the layout both must produce, ``moved`` its bytes (dense read + layout written)."""
    keep = keep_count(raw.shape[-1], sp)
    recs = []
    if fused.can_run_cuda(raw):
        got = fused.prune_encode(raw, kind, keep, backend="cuda")
        same = got.same_bytes(ref)
        del got
        tm = ctx.timer.time(lambda: fused.prune_encode(raw, kind, keep, backend="cuda")) if same else None
        recs.append(B.make_record(ctx.env, f"bitmap_prune_encode_{name}", "bitmap_cuda", shape, b, t, ctx.dtype, tm, moved,
                                  sparsity=sp, rel=0.0 if same else None, status="ok" if same else "wrong", data=data))
    tm = ctx.timer.time(lambda: fused.prune_encode_reference(raw, kind, keep))
    recs.append(B.make_record(ctx.env, f"bitmap_prune_encode_{name}", "bitmap_torch", shape, b, t, ctx.dtype, tm, moved,
                              sparsity=sp, rel=0.0, data=data))
    return recs


@register_suite('spmv', ('cublas_qk', 'cublas_pv'),
                'Bitmap K·q and P·V products alone vs torch.matmul (cuBLAS) on the dense tensors.',
                'kvtool bench spmv --batch 8 --seq 32k --sparsity 0.5,0.7')
def suite_spmv(ctx: BenchContext) -> list[dict]:
    """The two SpMV halves of bitmap attention alone (:mod:`kvtool.kernels.bitmap_spmv`: ``bitmap_qk`` /
    ``bitmap_pv``, with the attention kernel's block expansion) vs torch.matmul (cuBLAS)
    on the dense tensors: scores q·Kᵀ and P·V, per sparsity."""
    popc = require_kernel("bitmap_spmv", "spmv", ("bitmap_qk", "bitmap_pv"))
    comp = require_kernel("bitmap_compress", "spmv", ("encode",))
    backend = "triton" if ctx.env.device_type == "cuda" else "torch"
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        if ctx.baselines:
            recs += dense_records(ctx, shape, q, k, v, data, kernel="spmv_qk", which=("cublas_qk",))
            recs += dense_records(ctx, shape, q, k, v, data, kernel="spmv_pv", which=("cublas_pv",))
        g = shape.group
        for sp in ctx.sparsities:
            kp, vp = prune_per_token(k, sp), prune_per_token(v, sp)
            kb, vb = comp.encode(kp, "keys", backend), comp.encode(vp, "values", backend)
            kb.validate()
            vb.validate()
            s_ref = torch.matmul(B.grouped(q, shape.kv_heads).float(), kp.float().transpose(-1, -2)).reshape(b, shape.heads, t)
            p = torch.softmax(s_ref * ctx.scale, dim=-1).to(ctx.dtype)
            pv_ref = torch.matmul(p.view(b, shape.kv_heads, g, t).float(), vp.float()).reshape(b, shape.heads, -1)
            del kp, vp
            ctx.step(f"spmv_qk b={b} T={t} sparsity={sp}")
            fn = lambda kb=kb: popc.bitmap_qk(q, kb)  # noqa: E731
            tm, rel, st = timed(ctx, fn, fn(), s_ref)
            recs.append(B.make_record(ctx.env, "spmv_qk", "bitmap_qk", shape, b, t, ctx.dtype, tm,
                                      B.tensor_bytes(kb.nz, kb.bitmaps, kb.offsets, q), sparsity=sp, rel=rel, status=st, data=data))
            ctx.step(f"spmv_pv b={b} T={t} sparsity={sp}")
            fn = lambda vb=vb, p=p: popc.bitmap_pv(p, vb)  # noqa: E731
            tm, rel, st = timed(ctx, fn, fn(), pv_ref)
            recs.append(B.make_record(ctx.env, "spmv_pv", "bitmap_pv", shape, b, t, ctx.dtype, tm,
                                      B.tensor_bytes(vb.nz, vb.bitmaps, vb.offsets, p), sparsity=sp, rel=rel, status=st, data=data))
            del kb, vb, p, s_ref, pv_ref
            free_memory(ctx)
        del q, k, v
        free_memory(ctx)
    speedups_per_kernel(recs, ["cublas_qk", "cublas_pv"])
    return recs
