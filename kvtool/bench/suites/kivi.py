"""KIVI decode attention: the kernel that reads the ``quant`` format's stored bytes, against dense
decode and against dequantising the layer in torch first (what the live KIVI layer did before)."""

from __future__ import annotations

from kvtool.bench import harness as B
from kvtool.bench.suites.common import BenchContext, dense_records, free_memory, register_suite, require_kernel, timed
from kvtool.core.cache import LayerKV
from kvtool.formats import _rotated
from kvtool.formats.quant import QuantFormat, QuantParams

KIVI_DENSE = ("cublas_qk+pv", "sdpa", "flashinfer_batch", "flashinfer_batch_tc")
# provider, bits, group, residual, rotate: the format's defaults at 2 and 4 bits, the 15% plan's
# storage, and 2 bits in groups of 128 plain and Hadamard-rotated (the rotation's cost on the kernel)
KIVI_CONFIGS = (("kivi2", 2, 32, 32, "none"), ("kivi4", 4, 32, 32, "none"), ("kivi4_g128", 4, 128, 0, "none"),
                ("kivi2_g128", 2, 128, 0, "none"), ("rkivi2_g128", 2, 128, 0, "hadamard"))
DEQUANT = "kivi4_decode_sdpa"
TRITON = "_triton"  # suffix: the same layer through the Triton packed kernel (backend="triton"), where CUDA serves the call


@register_suite('kivi', (B.BEST_DENSE, 'sdpa', 'flashinfer_batch', 'kivi4_decode_sdpa'),
                'KIVI decode attention over the stored 2/4-bit codes vs dense decode and vs dequantising in torch then SDPA.',
                'kvtool bench kivi --batch 1,8 --seq 4k,32k --cuda-graph -o kivi.json')
def suite_kivi(ctx: BenchContext) -> list[dict]:
    """The KIVI kernel (:func:`kvtool.kernels.kivi_attention.kivi_attention`, as a user calls it:
    the CUDA backend where it serves the call, ``*_triton`` the same layer through the Triton
    packed kernel) on each layer the
    format encodes from the same random keys and values: 2 and 4 bits at the defaults (group 32,
    residual 32), 4 bits in groups of 128 with no residual (the 15% plan's storage), and 2 bits in
    groups of 128 plain and Hadamard-rotated (``rkivi2_g128``: the query rotated in and the output
    rotated back around the same kernel, as the live layer does); bytes =
    every stored tensor + q. ``kivi4_decode_sdpa``: the 4-bit layer decoded to dense in torch, then
    SDPA (the path without the kernel). Each checked against the format's reference (decode, then
    fp32 attention) first."""
    km = require_kernel("kivi_attention", "kivi", ("kivi_attention", "cache_from_encoded"))
    fmt = QuantFormat()
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        if ctx.baselines:
            recs += dense_records(ctx, shape, q, k, v, data, kernel="kivi", which=KIVI_DENSE)
        q4 = q[:, :, None]
        for provider, bits, group, residual, rotate in KIVI_CONFIGS:
            ctx.step(f"{provider} encode b={b} T={t}")
            enc = fmt.encode(LayerKV(k, v), QuantParams(bits=bits, group=group, residual=residual, rotate=rotate))
            ref = fmt.attend(q4, enc, ctx.scale)[0][:, :, 0]
            moved = fmt.traffic_bytes(enc) + B.tensor_bytes(q)
            cache = km.cache_from_encoded(_rotated.without_rotation(enc))
            ctx.step(f"{provider} b={b} T={t}")
            if rotate == "none":
                fn = lambda cache=cache: km.kivi_attention(q4, cache, ctx.scale)  # noqa: E731
            else:  # what the live layer runs: the query rotated in, the kernel, the output rotated back
                mat = _rotated.shared_matrix(q.shape[-1], _rotated.stored_signs(enc), q.device)

                def fn(cache=cache, mat=mat):
                    out = km.kivi_attention(_rotated.turn(q4, mat), cache, ctx.scale)[0]
                    return (_rotated.turn(out, mat, back=True),)
            tm, rel, st = timed(ctx, fn, fn()[0][:, :, 0], ref)
            recs.append(B.make_record(ctx.env, "kivi", provider, shape, b, t, ctx.dtype, tm, moved, rel=rel, status=st, data=data))
            if rotate == "none" and km.cuda_path(q4, cache) is None:
                ctx.step(f"{provider}{TRITON} b={b} T={t}")
                fn = lambda cache=cache: km.kivi_attention(q4, cache, ctx.scale, backend="triton")  # noqa: E731
                tm, rel, st = timed(ctx, fn, fn()[0][:, :, 0], ref)
                recs.append(B.make_record(ctx.env, "kivi", provider + TRITON, shape, b, t, ctx.dtype, tm, moved, rel=rel, status=st, data=data))
            if provider == "kivi4":
                ctx.step(f"{DEQUANT} b={b} T={t}")

                def dequantised(enc=enc):
                    dense = fmt.decode(enc)
                    return B.sdpa_decode(q, dense.keys, dense.values, ctx.scale)

                tm, rel, st = timed(ctx, dequantised, dequantised(), ref)
                recs.append(B.make_record(ctx.env, "kivi", DEQUANT, shape, b, t, ctx.dtype, tm, moved, rel=rel, status=st, data=data))
            del enc, ref, cache
            free_memory(ctx)
        del q, k, v, q4
        free_memory(ctx)
    B.add_speedups(recs, [B.BEST_DENSE, *KIVI_DENSE, DEQUANT])
    return recs
