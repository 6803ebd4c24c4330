"""Running one ``kvtool bench`` suite: the context from the options, the result document."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kvtool.bench import harness as B
from kvtool.bench.suites import BenchContext, load_suites
from kvtool.core.documents import read_bench_document
from kvtool.core.errors import UsageError
from kvtool.core.limits import MAX_PAGE_SIZE, MAX_TOKENS, bounded_int

DTYPES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_int_list(text: str, what: str) -> list[int]:
    """``"4096,32k,128K"`` -> ``[4096, 32768, 131072]`` (k = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            val = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise UsageError(f"--{what}: {part!r} is not an integer (lists look like 1,8,32 or 4k,32k)") from None
        out.append(bounded_int(f"--{what}", val, 1, MAX_TOKENS))
    if not out:
        raise UsageError(f"--{what} is empty")
    return out


def parse_float_list(text: str, what: str, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            val = float(part)
        except ValueError:
            raise UsageError(f"--{what}: {part!r} is not a number") from None
        if not (lo <= val < hi):
            raise UsageError(f"--{what}: {val} is outside [{lo}, {hi})")
        out.append(val)
    if not out:
        raise UsageError(f"--{what} is empty")
    return out


def build_context(sub: str, model_shape: str, heads, kv_heads, head_dim, batch: str, seq: str, sparsity: str, budget: str,
                  k: str | None, dtype: str, capture: Path | None, layer: int | None, cold_l2: bool, warmup_ms: float,
                  rep_ms: float, page_size: int, window: int, host_overhead: bool = False, cuda_graph: bool = False, step=None,
                  backend: str = "auto"):
    shape = B.model_shape(model_shape, heads, kv_heads, head_dim)
    if dtype.lower() not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use fp16 or bf16")
    if capture is not None and not Path(capture).is_file():
        raise UsageError(f"--capture {capture}: no such file")
    bounded_int("--page-size", page_size, 1, MAX_PAGE_SIZE)
    bounded_int("--window", window, 0, MAX_TOKENS)
    if backend not in ("auto", "triton", "cuda"):
        raise UsageError(f"--backend {backend!r}: use auto, triton or cuda")
    env = B.detect_env(cold_l2=cold_l2)
    ks = parse_int_list(k, "k") if k else [max(1, shape.heads // 2)]
    if any(x > shape.heads for x in ks):
        raise UsageError(f"--top-k {max(ks)} is more than the {shape.heads} query heads")
    timer = B.Timer(env, warmup_ms=warmup_ms, rep_ms=rep_ms, hide_launch=not host_overhead, cuda_graph=cuda_graph)
    if env.device_type == "cuda":
        env.notes.append("timings include host launch overhead" if host_overhead else "device time: launches queued behind a GPU sleep before each start event")
    return BenchContext(
        env=env, timer=timer, shape=shape, batches=parse_int_list(batch, "batch"), seqs=parse_int_list(seq, "seq"),
        dtype=getattr(torch, DTYPES[dtype.lower()]), sparsities=parse_float_list(sparsity, "sparsity"),
        budgets=parse_int_list(budget, "budget"), ks=ks, capture=capture, layer=layer, page_size=page_size,
        window=window, step=step or (lambda msg: None), backend=backend,
    )


SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, what: str) -> int:
    """``"40GiB"`` -> bytes (units B, KB, MB, GB, TB and KiB, MiB, GiB, TiB)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = (m.group(2).lower() if m else "") or "b"
    if not m or unit not in SIZE_UNITS:
        raise UsageError(f"--{what}: {text!r} is not a size like 40GiB or 500MB")
    value = int(float(m.group(1)) * SIZE_UNITS[unit])
    if value < 1:
        raise UsageError(f"--{what} must be positive")
    return value


def build_decode_context(model_shape: str, model: str | None, batch: str, seq: str, formats: list[str] | None, plan: list[Path] | None,
                         memory_budget: str | None, runs: int, dtype: str, step=None, budget_only: bool = False, generate: int = 0,
                         encode_repeats: int = 5) -> Any:
    """The context of ``kvtool bench decode``: a named model shape (:mod:`kvtool.hf.shapes`) or a
    model folder, the providers, the sweep and the budget."""
    if dtype.lower() not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use fp16 or bf16")
    if runs < 3:
        raise UsageError("--runs must be at least 3")
    env = B.detect_env(cold_l2=False)
    shape = B.ModelShape(model or model_shape, 0, 0, 0)
    if model is None:
        try:
            from kvtool.hf.shapes import shape_named  # deferred: the hf layer loads only for the decode suite

            s = shape_named(model_shape)
            shape = B.ModelShape(s.name, s.heads, s.kv_heads, s.head_dim)
        except ImportError:
            shape = B.model_shape(model_shape)
    if generate < 0:
        raise UsageError("--generate must be 0 (off) or a number of tokens")
    if encode_repeats < 0:
        raise UsageError("--encode-repeats must be 0 (off) or more")
    if budget_only and not memory_budget:
        raise UsageError("--budget-only needs --memory-budget")
    for p in plan or []:
        if not Path(p).is_file():
            raise UsageError(f"--plan {p}: no such file")
    specs = list(formats or []) + [str(p) for p in plan or []]
    if env.device_type == "cuda":
        env.notes.append("decode steps: a CUDA graph of the whole step, replayed; times are device times of the replays")
    timer = B.Timer(env, hide_launch=False)
    return BenchContext(
        env=env, timer=timer, shape=shape, batches=parse_int_list(batch, "batch"), seqs=parse_int_list(seq, "seq"),
        dtype=getattr(torch, DTYPES[dtype.lower()]), step=step or (lambda msg: None),
        options={"model": model, "formats": specs or None, "memory_budget": parse_size(memory_budget, "memory-budget") if memory_budget else None, "runs": runs,
                 "budget_only": budget_only, "generate": generate, "encode_repeats": encode_repeats},
    )


def run_suite(sub: str, ctx) -> dict[str, Any]:
    """Run one subcommand's suite; the result document written by --json."""
    suites = load_suites()
    if sub not in suites:
        raise B.BenchUnavailable(f"kvtool bench {sub}: no suite for it in this checkout")
    primary = suites[sub].baselines
    records = suites[sub].run(ctx)
    if ctx.timer.graph_errors:
        ctx.env.notes.append(f"{len(ctx.timer.graph_errors)} provider(s) could not be captured in a CUDA graph and were timed "
                             f"as launches (method 'stream'); first reason: {ctx.timer.graph_errors[0]}")
    return {
        "kvtool_bench": 1,
        "subcommand": sub,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": source_commit(),
        "command": "kvtool " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(("kvtool", "__main__.py")) else None,
        "env": ctx.env.to_dict(),
        "shape": _shape_of(ctx, records),
        "primary_baselines": list(primary),
        "records": records,
    }


def _shape_of(ctx, records: list[dict]) -> dict[str, Any]:
    """The attention shape timed: the model shape, or with --capture the captured model's."""
    if (ctx.capture is not None or ctx.options.get("model")) and records:
        r = records[0]
        return {"name": r["data"], "heads": r["heads"], "kv_heads": r["kv_heads"], "head_dim": r["head_dim"]}
    return {"name": ctx.shape.name, "heads": ctx.shape.heads, "kv_heads": ctx.shape.kv_heads, "head_dim": ctx.shape.head_dim}


def read_bench_json(path: Path) -> dict[str, Any]:
    """A ``kvtool bench -o`` document, checked field by field (BadDataError naming the file and the
    field when it is not one; :func:`kvtool.core.documents.check_bench_document`)."""
    return read_bench_document(path)


def source_commit(folder: Path | None = None) -> str | None:
    """The kvtool commit being timed: ``$KVTOOL_COMMIT`` (set it where the tree has no .git, as on a
    copied working tree), else ``git rev-parse`` of the source folder with ``+changes`` appended
    when the package's files differ from that commit (uncommitted edits, or a copied tree whose
    .git is older than its files), else None. ``folder``: the package folder (default: kvtool's)."""
    if os.environ.get("KVTOOL_COMMIT"):
        return os.environ["KVTOOL_COMMIT"]
    folder = folder or Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=5)
        head = out.stdout.strip()
        if not head:
            return None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head + "+changes" if changed.stdout.strip() else head
