"""What each ``kvtool bench`` subcommand times: the kernel, its baselines, the bytes it must read.

A suite is a function ``suite(ctx) -> list[record]`` (records from :func:`kvtool.bench.make_record`).
Every kernel is checked against its plain-torch reference (or the dense fp32 attention) before it is
timed; a kernel that fails its check gets ``status: wrong`` and no timing. Kernel modules are imported
lazily: when one is not in this checkout the suite raises :class:`~kvtool.bench.BenchUnavailable`
naming the module.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import bench as B
from .bench import BenchEnv, BenchUnavailable, ModelShape, Timer
from .errors import KvtoolError

# relative L2 error allowed against the fp32 reference (fp16 / bf16 operands, fp32 accumulation)
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


@dataclass
class BenchContext:
    """Everything a suite needs: environment, timer, shapes and the sweep lists."""

    env: BenchEnv
    timer: Timer
    shape: ModelShape
    batches: list[int]
    seqs: list[int]
    dtype: torch.dtype
    sparsities: list[float] = field(default_factory=lambda: [0.5, 0.7])
    budgets: list[int] = field(default_factory=lambda: [2048])
    ks: list[int] = field(default_factory=list)
    capture: Path | None = None
    layer: int | None = None
    page_size: int = 16
    window: int = 32
    baselines: bool = True
    step: Callable[[str], None] = lambda msg: None
    backend: str = "auto"  # bitmap attention: auto, triton or cuda

    @property
    def device(self) -> torch.device:
        return B.device_of(self.env)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.shape.head_dim)

    def configs(self):
        """(batch, seq) pairs of the sweep."""
        for b in self.batches:
            for t in self.seqs:
                yield b, t

    def inputs(self, batch: int, seq: int, seed: int = 0):
        """(shape, q, keys, values, data label) for one configuration, random or from ``--capture``."""
        if self.capture is not None:
            shape, q, k, v = B.capture_decode_inputs(self.capture, self.layer, batch, seq, self.dtype, self.device)
            B.check_size(self.env, batch, shape.kv_heads, seq, shape.head_dim)
            return shape, q, k, v, f"capture:{Path(self.capture).name}"
        B.check_size(self.env, batch, self.shape.kv_heads, seq, self.shape.head_dim)
        q, k, v = B.random_decode_inputs(self.shape, batch, seq, self.dtype, self.device, seed)
        return self.shape, q, k, v, "random"


def require_kernel(module: str, subcommand: str, names: tuple[str, ...] = ()):
    """Import ``kvtool.kernels.<module>``; a clear BenchUnavailable when it (or a name) is missing."""
    full = f"kvtool.kernels.{module}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name in (full, "kvtool.kernels"):
            raise BenchUnavailable(
                f"kvtool bench {subcommand}: the kernel module {full} is not in this checkout, so there is "
                f"nothing to time (`kvtool bench dense` times the baselines alone)"
            ) from None
        raise
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise BenchUnavailable(f"kvtool bench {subcommand}: {full} has no {', '.join(missing)}; this checkout's kernel API differs from the one the bench expects")
    return mod


def _timed(ctx: BenchContext, fn: Callable[[], Any], out: torch.Tensor | None, ref: torch.Tensor | None, tol: float | None = None):
    """(timing or None, rel_err, status): check ``out`` against ``ref`` first, time only if right."""
    rel = None
    if out is not None and ref is not None:
        rel = B.rel_err(out.float().reshape(ref.shape), ref)
        limit = TOL.get(ctx.dtype, 1e-2) if tol is None else tol
        if not (rel <= limit):
            return None, rel, "wrong"
    return ctx.timer.time(fn), rel, "ok"


# --------------------------------------------------------------------------- dense baselines


DENSE_BASELINES = ("cublas_qk", "cublas_pv", "cublas_qk+pv", "torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch",
                   "flashinfer_batch_tc")


def dense_records(ctx: BenchContext, shape: ModelShape, q, k, v, data: str, kernel: str = "dense",
                  which: tuple[str, ...] = DENSE_BASELINES) -> list[dict]:
    """Time the dense baselines on (q ``[B,H,D]``, keys / values ``[B,Hkv,T,D]``)."""
    env, dt = ctx.env, ctx.dtype
    b, hkv, t, d = k.shape
    scale = ctx.scale
    recs = []
    qg = B.grouped(q, hkv)
    ref = B.reference_decode(q, k, v, scale)
    s_ref = torch.matmul(qg.float(), k.float().transpose(-1, -2))
    p = torch.softmax(s_ref * scale, dim=-1).to(dt)
    pv_ref = torch.matmul(p.float(), v.float())
    kb, vb, qb = B.tensor_bytes(k), B.tensor_bytes(v), B.tensor_bytes(q)

    def rec(provider, timing, nbytes, rel, status):
        recs.append(B.make_record(env, kernel, provider, shape, b, t, dt, timing, nbytes, rel=rel, status=status, data=data))

    if "cublas_qk" in which:
        ctx.step(f"cublas_qk b={b} T={t}")
        tm, rel, st = _timed(ctx, lambda: B.cublas_qk(qg, k), B.cublas_qk(qg, k), s_ref)
        rec("cublas_qk", tm, kb + qb, rel, st)
    if "cublas_pv" in which:
        ctx.step(f"cublas_pv b={b} T={t}")
        tm, rel, st = _timed(ctx, lambda: B.cublas_pv(p, v), B.cublas_pv(p, v), pv_ref)
        rec("cublas_pv", tm, vb + B.tensor_bytes(p), rel, st)
    if "cublas_qk+pv" in which:
        ctx.step(f"cublas_qk+pv b={b} T={t}")

        def both():
            B.cublas_qk(qg, k)
            return B.cublas_pv(p, v)

        tm, rel, st = _timed(ctx, both, both(), pv_ref)
        rec("cublas_qk+pv", tm, kb + vb + qb, rel, st)
    if "torch_dense" in which:
        ctx.step(f"torch_dense b={b} T={t}")
        fn = lambda: B.torch_dense_decode(q, k, v, scale)  # noqa: E731
        tm, rel, st = _timed(ctx, fn, fn(), ref)
        rec("torch_dense", tm, kb + vb + qb, rel, st)
    if "sdpa" in which:
        ctx.step(f"sdpa b={b} T={t}")
        fn = lambda: B.sdpa_decode(q, k, v, scale)  # noqa: E731
        try:
            out = fn()
        except Exception as exc:  # a backend that refuses this shape: say so, keep going
            rec("sdpa", None, kb + vb, None, f"skipped: {type(exc).__name__}: {str(exc)[:120]}")
        else:
            tm, rel, st = _timed(ctx, fn, out, ref)
            rec("sdpa", tm, kb + vb + qb, rel, st)
    fi_wanted = [w for w in ("flashinfer_single", "flashinfer_batch", "flashinfer_batch_tc") if w in which]
    if fi_wanted:
        fi = B.flashinfer_module()
        if fi is None or env.device_type != "cuda":
            status = B.NOT_INSTALLED if fi is None else "skipped: needs CUDA"
            for w in fi_wanted:
                rec(w, None, kb + vb, None, status)
        else:
            try:
                fid = B.FlashInferDecode(fi, k, v, shape.heads, scale, ctx.page_size)
            except Exception as exc:
                for w in fi_wanted:
                    rec(w, None, kb + vb, None, f"skipped: {type(exc).__name__}: {str(exc)[:160]}")
            else:
                if "flashinfer_single" in which:
                    if b == 1:
                        ctx.step(f"flashinfer_single b={b} T={t}")
                        fn = lambda: fid.single(q[0])  # noqa: E731
                        try:
                            out = fn()
                        except Exception as exc:
                            rec("flashinfer_single", None, kb + vb, None, f"skipped: {type(exc).__name__}: {str(exc)[:160]}")
                        else:
                            tm, rel, st = _timed(ctx, fn, out, ref[0])
                            rec("flashinfer_single", tm, kb + vb + qb, rel, st)
                    else:
                        rec("flashinfer_single", None, kb + vb, None, "skipped: single request (batch 1) only")
                for name, tc in (("flashinfer_batch", False), ("flashinfer_batch_tc", True)):
                    if name not in which:
                        continue
                    ctx.step(f"{name} b={b} T={t}")
                    fn = lambda tc=tc: fid.batch(q, tc)  # noqa: E731
                    try:
                        out = fn()
                    except Exception as exc:
                        rec(name, None, kb + vb, None, f"skipped: {type(exc).__name__}: {str(exc)[:160]}")
                        continue
                    tm, rel, st = _timed(ctx, fn, out, ref)
                    rec(name, tm, kb + vb + qb, rel, st)
                fid.free()
    return recs


def suite_dense(ctx: BenchContext) -> list[dict]:
    """The dense decode-attention baselines alone, over the batch x seq sweep."""
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        recs += dense_records(ctx, shape, q, k, v, data)
        del q, k, v
        _free(ctx)
    B.add_speedups(recs, list(DENSE_BASELINES))
    return recs


def prune_per_token(x: torch.Tensor, sparsity: float, window: int = 0) -> torch.Tensor:
    """Per-token magnitude pruning (Mustafar's default): each token of ``x`` ``[B, Hkv, T, D]`` keeps
    its ``round((1 - sparsity) * D)`` largest |x| (ties to the lower channel); the last ``window``
    tokens stay dense. Returns a new tensor (pruned elements +0.0)."""
    d = x.shape[-1]
    keep = int(round((1.0 - sparsity) * d))
    out = x.clone()
    tc = x.shape[2] - window
    if tc <= 0 or keep >= d:
        return out
    part = out[:, :, :tc]
    mask = torch.zeros(part.shape, dtype=torch.bool, device=x.device)
    if keep > 0:
        mask.scatter_(-1, part.abs().topk(keep, dim=-1, sorted=False).indices, True)
    part.masked_fill_(~mask, 0)
    return out


ATTENTION_BASELINES = ("cublas_qk+pv", "torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch", "flashinfer_batch_tc")


def _bitmap_bytes(cache) -> int:
    kb, vb = cache.keys, cache.values
    return B.tensor_bytes(kb.nz, kb.bitmaps, kb.offsets, vb.nz, vb.bitmaps, vb.offsets, cache.window_keys, cache.window_values)


def suite_attention(ctx: BenchContext) -> list[dict]:
    """Bitmap sparse decode attention (keys and values pruned per token to each sparsity, the last
    ``window`` tokens dense; layout v2, :mod:`kvtool.kernels.bitmap_sparse_attention` with
    ``ctx.backend``, reported as ``bitmap_triton`` with the backend that ran in ``backend``) vs the
    dense baselines on the unpruned tensors of the same shape."""
    att = require_kernel("bitmap_sparse_attention", "attention", ("bitmap_sparse_attention", "encode_cache_v2", "stage_capacity", "pick_backend"))
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
            cache.validate()
            which = att.pick_backend(q, ctx.backend)
            cap = att.stage_capacity(cache) if which == "cuda" else None
            ref = B.reference_decode(q, kp, vp, ctx.scale)
            del kp, vp
            # the layout was validated above, so the timed calls skip it
            ctx.step(f"bitmap_triton b={b} T={t} sparsity={sp}")
            fn = lambda cache=cache, cap=cap, which=which: att.bitmap_sparse_attention(q4, cache, ctx.scale, backend=which, validate=False, capacity=cap)  # noqa: E731
            tm, rel, st = _timed(ctx, fn, fn()[0], ref)
            recs.append(B.make_record(ctx.env, "bitmap_attention", "bitmap_triton", shape, b, t, ctx.dtype, tm,
                                      _bitmap_bytes(cache) + B.tensor_bytes(q), sparsity=sp, rel=rel, status=st, data=data,
                                      backend=which))
            del cache, ref
            _free(ctx)
        del q, k, v, q4
        _free(ctx)
    B.add_speedups(recs, list(ATTENTION_BASELINES))
    return recs


def suite_compress(ctx: BenchContext) -> list[dict]:
    """Bitmap compression throughput: the Triton encoder vs the torch encoder on the same pruned keys
    and values (bytes = dense input read + layout written; ``bandwidth_fraction`` against copy, which
    also counts read + write). The outputs must be byte-identical."""
    comp = require_kernel("bitmap_compress", "compress", ("encode_torch", "encode_triton"))
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        del q
        for sp in ctx.sparsities:
            # layout v2 orientations: keys as token tiles, values as channel tiles
            for name, kind, x in (("keys", "values", prune_per_token(k, sp)), ("values", "keys", prune_per_token(v, sp))):
                ctx.step(f"bitmap compress {name} b={b} T={t} sparsity={sp}")
                ref = comp.encode_torch(x, kind)
                moved = B.tensor_bytes(x) + B.tensor_bytes(ref.nz, ref.bitmaps, ref.offsets)
                got = comp.encode_triton(x, kind) if ctx.env.device_type == "cuda" or B.interpret_mode() else None
                same = got is not None and all(torch.equal(a.view(torch.int8) if a.is_floating_point() else a, c.view(torch.int8) if c.is_floating_point() else c)
                                               for a, c in ((got.nz, ref.nz), (got.bitmaps, ref.bitmaps), (got.offsets, ref.offsets)))
                tm = ctx.timer.time(lambda: comp.encode_triton(x, kind)) if same else None
                recs.append(B.make_record(ctx.env, f"bitmap_compress_{name}", "bitmap_triton", shape, b, t, ctx.dtype, tm, moved,
                                          sparsity=sp, rel=0.0 if same else None, status="ok" if same else "wrong", data=data))
                tm = ctx.timer.time(lambda: comp.encode_torch(x, kind))
                recs.append(B.make_record(ctx.env, f"bitmap_compress_{name}", "bitmap_torch", shape, b, t, ctx.dtype, tm, moved,
                                          sparsity=sp, rel=0.0, data=data))
                del x, ref, got
                _free(ctx)
        recs += _retrieval_encode_records(ctx, shape, b, t, k, v, data)
        del k, v
        _free(ctx)
    _speedups_per_kernel(recs, ["bitmap_torch"])
    return recs


def _retrieval_encode_records(ctx: BenchContext, shape: ModelShape, b: int, t: int, k, v, data: str) -> list[dict]:
    """Encoding throughput of the sign-VQ and page-statistics formats (their encoders are torch, run
    on the device of the tensors): bytes = dense keys + values read + every encoded tensor written."""
    from .cache import LayerKV

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


def _speedups_per_kernel(recs: list[dict], baselines: list[str]) -> None:
    """add_speedups within each kernel name (for suites whose rows of one configuration time
    different things, e.g. keys and values)."""
    for name in {r["kernel"] for r in recs}:
        B.add_speedups([r for r in recs if r["kernel"] == name], baselines)


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
        tm, rel, st = _timed(ctx, fn, fn()[0], ref)
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
        _free(ctx)
    B.add_speedups(recs, list(HEADS_BASELINES))
    return recs


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
            tm, rel, st = _timed(ctx, fn, fn(), s_ref)
            recs.append(B.make_record(ctx.env, "spmv_qk", "bitmap_qk", shape, b, t, ctx.dtype, tm,
                                      B.tensor_bytes(kb.nz, kb.bitmaps, kb.offsets, q), sparsity=sp, rel=rel, status=st, data=data))
            ctx.step(f"spmv_pv b={b} T={t} sparsity={sp}")
            fn = lambda vb=vb, p=p: popc.bitmap_pv(p, vb)  # noqa: E731
            tm, rel, st = _timed(ctx, fn, fn(), pv_ref)
            recs.append(B.make_record(ctx.env, "spmv_pv", "bitmap_pv", shape, b, t, ctx.dtype, tm,
                                      B.tensor_bytes(vb.nz, vb.bitmaps, vb.offsets, p), sparsity=sp, rel=rel, status=st, data=data))
            del kb, vb, p, s_ref, pv_ref
            _free(ctx)
        del q, k, v
        _free(ctx)
    _speedups_per_kernel(recs, ["cublas_qk", "cublas_pv"])
    return recs


RETRIEVAL_BASELINES = ("cublas_qk", "torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch", "flashinfer_batch_tc")


def suite_lut(ctx: BenchContext) -> list[dict]:
    """Sign-VQ: the LUT score kernel alone vs fp16 q·Kᵀ (cuBLAS), then the whole decode step (LUT
    scores, top-k, fused dequantising attention over the chosen tokens, full-precision tokens) per
    budget vs the dense baselines on the original keys / values."""
    sv = require_kernel("signvq_lut", "lut", ("lut_scores_kernel", "signvq_decode"))
    from .cache import LayerKV
    from .formats.signvq import SignVQFormat, SignVQParams, lut_scores

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
                tm, rel, st = _timed(ctx, fn, fn(), score_ref)
                recs.append(B.make_record(ctx.env, "signvq", "lut_scores", shape, b, t, ctx.dtype, tm,
                                          B.tensor_bytes(codes, book, q), rel=rel, status=st, data=data))
                del score_ref
            ctx.step(f"signvq_decode b={b} T={t} budget={budget}")
            ref = fmt.attend(q4, enc, ctx.scale)[0][:, :, 0]
            fn = lambda enc=enc: sv.signvq_decode(q4, enc, ctx.scale)  # noqa: E731
            tm, rel, st = _timed(ctx, fn, fn()[0][:, :, 0], ref)
            recs.append(B.make_record(ctx.env, "signvq", "signvq_decode", shape, b, t, ctx.dtype, tm, fmt.traffic_bytes(enc, q4),
                                      budget=budget, rel=rel, status=st, data=data))
            del enc, ref
            _free(ctx)
        del q, k, v, q4
        _free(ctx)
    B.add_speedups(recs, list(RETRIEVAL_BASELINES))
    return recs


def suite_pages(ctx: BenchContext) -> list[dict]:
    """Page selection (pagestat, UNIQUE score): fused criticality alone, and the whole decode step
    (criticality, top-k pages, paged sparse attention) per budget vs the dense baselines."""
    pg = require_kernel("pages", "pages", ("page_criticality", "pagestat_decode", "pagestat_decode_reference"))
    from .cache import LayerKV
    from .formats.pagestat import PageStatFormat, PageStatParams, page_scores

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
                tm, rel, st = _timed(ctx, fn, fn(), crit_ref)
                recs.append(B.make_record(ctx.env, "pagestat", "page_criticality", shape, b, t, ctx.dtype, tm,
                                          B.tensor_bytes(q, *stats.values()), rel=rel, status=st, data=data))
                del crit_ref
            ref = pg.pagestat_decode_reference(q4, enc, ctx.scale)[0][:, :, 0]
            ctx.step(f"pagestat_decode b={b} T={t} budget={budget}")
            fn = lambda enc=enc: pg.pagestat_decode(q4, enc, ctx.scale)  # noqa: E731
            tm, rel, st = _timed(ctx, fn, fn()[0][:, :, 0], ref)
            recs.append(B.make_record(ctx.env, "pagestat", "pagestat_decode", shape, b, t, ctx.dtype, tm, fmt.traffic_bytes(enc, q4),
                                      budget=budget, rel=rel, status=st, data=data))
            del enc, ref, stats
            _free(ctx)
        del q, k, v, q4
        _free(ctx)
    B.add_speedups(recs, list(RETRIEVAL_BASELINES))
    return recs


def _free(ctx: BenchContext) -> None:
    if ctx.env.device_type == "cuda":
        torch.cuda.empty_cache()


# subcommand -> (suite, baselines whose speedup columns the table shows; the JSON has all)
SUITES: dict[str, tuple[Callable[[BenchContext], list[dict]], tuple[str, ...]]] = {
    "dense": (suite_dense, ("torch_dense", "flashinfer_batch")),
    "attention": (suite_attention, ("cublas_qk+pv", "flashinfer_batch", "flashinfer_single")),
    "compress": (suite_compress, ("bitmap_torch",)),
    "heads": (suite_heads, ("torch_dense", "flashinfer_batch", "heads_all")),
    "lut": (suite_lut, ("cublas_qk", "flashinfer_batch")),
    "spmv": (suite_spmv, ("cublas_qk", "cublas_pv")),
    "pages": (suite_pages, ("flashinfer_batch", "flashinfer_single")),
}
