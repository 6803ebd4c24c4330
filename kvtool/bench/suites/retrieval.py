"""Retrieval kernels: sign-VQ LUT scoring and page selection, each as a whole decode step."""

from __future__ import annotations


from kvtool.bench import harness as B
from kvtool.bench.suites.common import (
    BenchContext,
    dense_records,
    free_memory,
    register_suite,
    require_kernel,
    timed,
)
import importlib

from kvtool.bench.harness import ModelShape
from kvtool.core.errors import KvtoolError
from kvtool.core.cache import LayerKV
from kvtool.formats.pagestat import PageStatFormat, PageStatParams, pagestat_decode, pagestat_decode_reference
from kvtool.formats.signvq import SignVQFormat, SignVQParams, lut_scores, signvq_decode
from kvtool.kernels.pages import page_scores

def retrieval_encode_records(ctx: BenchContext, shape: ModelShape, b: int, t: int, k, v, data: str) -> list[dict]:
    """Encoding throughput of the sign-VQ and page-statistics formats (their encoders are torch, run
    on the device of the tensors): bytes = dense keys + values read + every encoded tensor written."""
    recs = []
    for name, module, fmt_cls, params_cls in (("signvq_encode", "signvq", "SignVQFormat", "SignVQParams"),
                                              ("pagestat_encode", "pagestat", "PageStatFormat", "PageStatParams")):
        try:
            mod = importlib.import_module(f"kvtool.formats.{module}")
        except ImportError:
            continue
        budget = min(max(ctx.budgets), t)
        fmt, params = getattr(mod, fmt_cls)(), getattr(mod, params_cls)(budget=budget, budget_ratio=None)
        layer = LayerKV(k, v)
        ctx.step(f"{name} b={b} T={t}")
        try:
            enc = fmt.encode(layer, params)
        except KvtoolError as exc:  # parameters that cannot apply at this size: say so, keep going
            recs.append(B.make_record(ctx.env, name, "torch", shape, b, t, ctx.dtype, None, 0, budget=budget,
                                      status=f"skipped: {exc}", data=data))
            continue
        moved = B.tensor_bytes(k, v) + enc.tensor_bytes()
        del enc
        tm = ctx.timer.time(lambda: fmt.encode(layer, params))
        recs.append(B.make_record(ctx.env, name, "torch", shape, b, t, ctx.dtype, tm, moved, budget=budget, data=data))
    return recs


RETRIEVAL_BASELINES = ("cublas_qk", "torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch", "flashinfer_batch_tc")


@register_suite('lut', ('cublas_qk', 'flashinfer_batch'),
                'Sign-VQ lookup-table scoring vs dense fp16 q·Kᵀ; then top-k + sparse attention vs FlashInfer dense.',
                'kvtool bench lut --batch 8 --seq 32k --budget 2048')
def suite_lut(ctx: BenchContext) -> list[dict]:
    """Sign-VQ: the LUT score kernel alone vs fp16 q·Kᵀ (cuBLAS), then the whole decode step (LUT
    scores, top-k, fused dequantising attention over the chosen tokens, full-precision tokens) per
    budget vs the dense baselines on the original keys / values."""
    sv = require_kernel("signvq_lut", "lut", ("lut_scores_kernel",))
    fmt = SignVQFormat()
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        if ctx.baselines:
            recs += dense_records(ctx, shape, q, k, v, data, kernel="signvq", which=RETRIEVAL_BASELINES)
        q4 = q[:, :, None]
        for i, budget in enumerate(ctx.budgets):
            if budget >= t:
                recs.append(B.make_record(ctx.env, "signvq", "signvq_decode", shape, b, t, ctx.dtype, None, 0, budget=budget,
                                          status=f"skipped: budget {budget} >= seq {t}", data=data))
                continue
            ctx.step(f"signvq encode b={b} T={t} budget={budget}")
            enc = fmt.encode(LayerKV(k, v), SignVQParams(budget=budget, budget_ratio=None))
            codes, book, gqa = enc.tensors["index.codes"], enc.tensors["index.codebook"], enc.meta["gqa"]
            if i == 0:
                score_ref = lut_scores(q4, codes, book, gqa)
                ctx.step(f"lut_scores b={b} T={t}")
                fn = lambda: sv.lut_scores_kernel(q4, codes, book, gqa)  # noqa: E731
                tm, rel, st = timed(ctx, fn, fn(), score_ref)
                recs.append(B.make_record(ctx.env, "signvq", "lut_scores", shape, b, t, ctx.dtype, tm,
                                          B.tensor_bytes(codes, book, q), rel=rel, status=st, data=data))
                del score_ref
            ctx.step(f"signvq_decode b={b} T={t} budget={budget}")
            ref = fmt.attend(q4, enc, ctx.scale)[0][:, :, 0]
            fn = lambda enc=enc: signvq_decode(q4, enc, ctx.scale)  # noqa: E731
            tm, rel, st = timed(ctx, fn, fn()[0][:, :, 0], ref)
            recs.append(B.make_record(ctx.env, "signvq", "signvq_decode", shape, b, t, ctx.dtype, tm, fmt.traffic_bytes(enc, q4),
                                      budget=budget, rel=rel, status=st, data=data))
            del enc, ref
            free_memory(ctx)
        del q, k, v, q4
        free_memory(ctx)
    B.add_speedups(recs, list(RETRIEVAL_BASELINES))
    return recs


@register_suite('pages', ('flashinfer_batch', 'flashinfer_single'),
                'Page criticality + top-k + paged sparse attention vs FlashInfer dense decode.',
                'kvtool bench pages --batch 8 --seq 128k --budget 2048')
def suite_pages(ctx: BenchContext) -> list[dict]:
    """Page selection (pagestat, UNIQUE score): fused criticality alone, and the whole decode step
    (criticality, top-k pages, paged sparse attention) per budget vs the dense baselines."""
    pg = require_kernel("pages", "pages", ("page_criticality",))
    fmt = PageStatFormat()
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        if ctx.baselines:
            recs += dense_records(ctx, shape, q, k, v, data, kernel="pagestat", which=RETRIEVAL_BASELINES)
        q4 = q[:, :, None]
        for i, budget in enumerate(ctx.budgets):
            if budget >= t:
                recs.append(B.make_record(ctx.env, "pagestat", "pagestat_decode", shape, b, t, ctx.dtype, None, 0, budget=budget,
                                          status=f"skipped: budget {budget} >= seq {t}", data=data))
                continue
            ctx.step(f"pagestat encode b={b} T={t} budget={budget}")
            enc = fmt.encode(LayerKV(k, v), PageStatParams(page_size=ctx.page_size, budget=budget, budget_ratio=None))
            m = enc.meta
            stats = {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}
            if i == 0:
                crit_ref = page_scores(q4, stats, m["score"], m["lam"]).float()
                ctx.step(f"page_criticality b={b} T={t}")
                fn = lambda stats=stats: pg.page_criticality(q4, stats, m["score"], m["lam"])  # noqa: E731
                tm, rel, st = timed(ctx, fn, fn(), crit_ref)
                recs.append(B.make_record(ctx.env, "pagestat", "page_criticality", shape, b, t, ctx.dtype, tm,
                                          B.tensor_bytes(q, *stats.values()), rel=rel, status=st, data=data))
                del crit_ref
            ref = pagestat_decode_reference(q4, enc, ctx.scale)[0][:, :, 0]
            ctx.step(f"pagestat_decode b={b} T={t} budget={budget}")
            fn = lambda enc=enc: pagestat_decode(q4, enc, ctx.scale)  # noqa: E731
            tm, rel, st = timed(ctx, fn, fn()[0][:, :, 0], ref)
            recs.append(B.make_record(ctx.env, "pagestat", "pagestat_decode", shape, b, t, ctx.dtype, tm, fmt.traffic_bytes(enc, q4),
                                      budget=budget, rel=rel, status=st, data=data))
            del enc, ref, stats
            free_memory(ctx)
        del q, k, v, q4
        free_memory(ctx)
    B.add_speedups(recs, list(RETRIEVAL_BASELINES))
    return recs
