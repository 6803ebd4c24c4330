"""What the ``kvtool bench`` suites share: the context, the check-then-time step, the dense baselines.

A suite is a function ``suite(ctx) -> list[record]`` (records from :func:`kvtool.bench.harness.make_record`).
Every kernel is checked against its plain-torch reference (or the dense fp32 attention) before it is
timed; a kernel that fails its check gets ``status: wrong`` and no timing. Kernel modules are imported
lazily: when one is not in this checkout the suite raises :class:`~kvtool.bench.harness.BenchUnavailable`
naming the module.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kvtool.bench import harness as B
from kvtool.bench.harness import BenchEnv, BenchUnavailable, ModelShape, Timer


@dataclass(frozen=True)
class Suite:
    """One ``kvtool bench`` subcommand: ``run(ctx) -> records``; ``baselines``: the speedup columns
    its table shows (the JSON has all); ``summary`` and ``example`` feed ``--help``."""

    name: str
    run: Callable[["BenchContext"], list[dict]]
    baselines: tuple[str, ...]
    summary: str
    example: str


SUITES: dict[str, Suite] = {}


def register_suite(name: str, baselines: tuple[str, ...], summary: str, example: str):
    """Decorator: make ``fn(ctx) -> records`` the ``kvtool bench NAME`` subcommand."""

    def wrap(fn: Callable[["BenchContext"], list[dict]]):
        SUITES[name] = Suite(name, fn, baselines, summary, example)
        return fn

    return wrap

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
    options: dict[str, Any] = field(default_factory=dict)  # a suite's own options (decode: model, formats, memory_budget, runs)

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


def timed(ctx: BenchContext, fn: Callable[[], Any], out: torch.Tensor | None, ref: torch.Tensor | None, tol: float | None = None):
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
        tm, rel, st = timed(ctx, lambda: B.cublas_qk(qg, k), B.cublas_qk(qg, k), s_ref)
        rec("cublas_qk", tm, kb + qb, rel, st)
    if "cublas_pv" in which:
        ctx.step(f"cublas_pv b={b} T={t}")
        tm, rel, st = timed(ctx, lambda: B.cublas_pv(p, v), B.cublas_pv(p, v), pv_ref)
        rec("cublas_pv", tm, vb + B.tensor_bytes(p), rel, st)
    if "cublas_qk+pv" in which:
        ctx.step(f"cublas_qk+pv b={b} T={t}")

        def both():
            B.cublas_qk(qg, k)
            return B.cublas_pv(p, v)

        tm, rel, st = timed(ctx, both, both(), pv_ref)
        rec("cublas_qk+pv", tm, kb + vb + qb, rel, st)
    if "torch_dense" in which:
        ctx.step(f"torch_dense b={b} T={t}")
        fn = lambda: B.torch_dense_decode(q, k, v, scale)  # noqa: E731
        tm, rel, st = timed(ctx, fn, fn(), ref)
        rec("torch_dense", tm, kb + vb + qb, rel, st)
    if "sdpa" in which:
        ctx.step(f"sdpa b={b} T={t}")
        fn = lambda: B.sdpa_decode(q, k, v, scale)  # noqa: E731
        try:
            out = fn()
        except Exception as exc:  # a backend that refuses this shape: say so, keep going
            rec("sdpa", None, kb + vb, None, f"skipped: {type(exc).__name__}: {str(exc)[:120]}")
        else:
            tm, rel, st = timed(ctx, fn, out, ref)
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
                            tm, rel, st = timed(ctx, fn, out, ref[0])
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
                    tm, rel, st = timed(ctx, fn, out, ref)
                    rec(name, tm, kb + vb + qb, rel, st)
                fid.free()
    return recs


def speedups_per_kernel(recs: list[dict], baselines: list[str]) -> None:
    """add_speedups within each kernel name (for suites whose rows of one configuration time
    different things, e.g. keys and values)."""
    for name in {r["kernel"] for r in recs}:
        B.add_speedups([r for r in recs if r["kernel"] == name], baselines)


def free_memory(ctx: BenchContext) -> None:
    if ctx.env.device_type == "cuda":
        torch.cuda.empty_cache()
