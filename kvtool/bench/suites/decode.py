"""``kvtool bench decode``: greedy decode of a model through each format's live cache against dense.

The measurement is :func:`kvtool.bench.decode.measure` (its docstring says what is timed and how);
this module sweeps providers x batch x context, and with ``--memory-budget`` finds each provider's
largest batch under a KV-cache budget and times it. Records carry the stable fields of the other
suites (``median_us`` is the decode step) plus ``tokens_per_s``, ``ms_per_token``, ``attention_share``,
``stored_bytes``, ``workspace_bytes``, ``peak_bytes`` and ``encode_us_per_token`` (the growth cost per
decoded position, median of repeated spans); with ``--generate N`` also ``generate_tokens_per_s``,
``generate_encode_share`` and ``generate_vs_step`` (:mod:`kvtool.bench.generation`).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtool.bench import harness as B
from kvtool.bench.suites.common import BenchContext, free_memory, register_suite
from kvtool.core.errors import UsageError

DEFAULT_FORMATS = (
    "bitmap:sparsity=0.7",
    "bitmap:sparsity=0.5",
    "quant:bits=4",
    "quant:bits=2",
    "signvq:budget_ratio=0.125",
    "pagestat:budget_ratio=0.125",
    "snapstream:budget=4096",
)
EXTRA_FIELDS = ("tokens_per_s", "ms_per_token", "attention_us", "attention_method", "attention_share", "stored_bytes", "dense_kv_bytes",
                "storage_ratio", "workspace_bytes", "weights_bytes", "peak_bytes", "build_peak_bytes", "peak_over_stated",
                "encode_us_per_token", "encode_us_p10", "encode_us_p90", "encode_repeats", "encode_span_tokens", "encode_step_share", "chunk",
                "capture_error", "build_s", "memory_budget", "throughput_vs_dense", "bounded_by", "generate_tokens", "generate_warmup_tokens", "generate_tokens_per_s",
                "generate_s", "generate_encode_share", "generate_encodes", "generate_method", "generate_recaptures", "generate_vs_step")


def load_model(ctx: BenchContext):
    """The model: a local folder / ``embedded`` (``--model``) or a named shape with seeded random
    weights built on the device (``--model-shape``, :mod:`kvtool.hf.shapes`)."""
    opts = ctx.options
    device = ctx.device
    if opts.get("model"):
        from kvtool.hf.models import load  # deferred: transformers loads only when a model is asked for

        spec = opts["model"]
        model, _, _ = load(None if spec == "embedded" else spec, device=str(device), torch_dtype=None if device.type == "cpu" else ctx.dtype)
        return model, getattr(model.config, "_name_or_path", spec) or spec
    try:
        from kvtool.hf.shapes import build_model  # deferred: transformers loads only when a model is asked for
    except ImportError:
        raise B.BenchUnavailable("kvtool bench decode --model-shape needs kvtool.hf.shapes (random-weight models); pass --model PATH") from None
    name = ctx.shape.name
    dtype = ctx.dtype if device.type == "cuda" else torch.float32
    return build_model(name, device=device, dtype=dtype, seed=0), f"random:{name}"


def record(ctx: BenchContext, info: Any, m: dict[str, Any], data: str, kernel: str = "decode") -> dict[str, Any]:
    timing = B.Timing(m["median_us"], m["p10_us"], m["p90_us"], m["runs"], m["method"])
    shape = B.ModelShape(data, info.heads, info.kv_heads, info.head_dim)
    rec = B.make_record(ctx.env, kernel, m["provider"], shape, m["batch"], m["seq"], info.dtype, timing, m["stored_bytes"] + info.weights_bytes, data=data)
    for name in EXTRA_FIELDS:
        rec[name] = m.get(name)
    return rec


def failed(ctx: BenchContext, info: Any, provider: str, batch: int, context: int, data: str, status: str, kernel: str = "decode") -> dict[str, Any]:
    shape = B.ModelShape(data, info.heads, info.kv_heads, info.head_dim)
    rec = B.make_record(ctx.env, kernel, provider, shape, batch, context, info.dtype, None, 0, data=data, status=status)
    for name in EXTRA_FIELDS:
        rec[name] = None
    return rec


def providers(ctx: BenchContext) -> list[str]:
    from kvtool.bench.decode import DENSE_FLASHINFER, DENSE_SDPA, flashinfer_module  # deferred: transformers loads only when the suite runs

    out = [DENSE_SDPA]
    if ctx.device.type == "cuda" and flashinfer_module() is not None:
        out.append(DENSE_FLASHINFER)
    return out + list(ctx.options.get("formats") or DEFAULT_FORMATS)


def fits(info: Any, provider: str, batch: int, context: int, free: int) -> bool:
    """Whether a dense cache (an upper bound for every format) or, for formats, a third of it fits
    the free memory: configurations that cannot are skipped instead of tried."""
    need = info.dense_bytes(batch, context)
    return (need if provider.startswith("dense/") else need // 3) < free


@register_suite('decode', ('dense/sdpa', 'dense/flashinfer'),
                'Greedy decode of a model through each format\'s live cache against dense (SDPA, FlashInfer): tokens/s, time per token, peak GPU memory, attention share; --memory-budget: the largest batch each format fits and its throughput.',
                'kvtool bench decode --model-shape llama3-8b --batch 1,8,32 --seq 4k,32k --memory-budget 40GiB -o decode.json')
def suite_decode(ctx: BenchContext) -> list[dict]:
    from kvtool.bench.decode import DENSE, ModelInfo, largest_batch, measure  # deferred: transformers loads only when the suite runs

    model, data = load_model(ctx)
    info = ModelInfo.of(model)
    if ctx.env.device_type == "cuda":
        ctx.env.notes.append(f"model {data}: {info.layers} layers, weights {info.weights_bytes / 2**30:.2f} GiB {str(info.dtype).removeprefix('torch.')}; "
                             "caches filled with random tokens; the step captured in a CUDA graph and replayed at a fixed context")
    runs = int(ctx.options.get("runs") or 20)
    gen = int(ctx.options.get("generate") or 0)
    repeats = int(ctx.options.get("encode_repeats", 5))
    if repeats or gen:
        ctx.env.notes.append(f"growth: the step replayed from a CUDA graph, every filled block / group encoded eagerly between replays, each encode "
                             f"timed between two synchronizes; encode_us_per_token = median over {repeats} spans of >= one block each, after a warm-up "
                             "encode" + (f"; --generate {gen}: after {gen} untimed tokens (first-use compilation), {gen} greedy tokens from right after an encode plus the encode of what they filled, "
                                         "one wall-clock interval" if gen else ""))
    recs: list[dict] = []
    names = providers(ctx)
    for b, t in ([] if ctx.options.get("budget_only") else ctx.configs()):
        for p in names:
            free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else 1 << 62
            if not fits(info, p, b, t, free):
                recs.append(failed(ctx, info, p, b, t, data, "skipped: does not fit beside the weights"))
                continue
            ctx.step(f"decode {p} batch {b} x {t}")
            try:
                recs.append(record(ctx, info, measure(model, p, b, t, runs=runs, generate_tokens=gen, encode_repeats=repeats), data))
            except torch.OutOfMemoryError:
                recs.append(failed(ctx, info, p, b, t, data, "skipped: out of memory"))
            except UsageError as exc:
                recs.append(failed(ctx, info, p, b, t, data, f"skipped: {exc}"))
            free_memory(ctx)
    budget = ctx.options.get("memory_budget")
    if budget:
        for t in ctx.seqs:
            for p in names:
                ctx.step(f"decode {p} under {budget / 2**30:.0f} GiB at {t} tokens")
                try:
                    b, bound = largest_batch(model, p, t, budget)
                    m = measure(model, p, b, t, runs=runs, growth=False)
                    m["bounded_by"] = bound
                except torch.OutOfMemoryError:
                    recs.append(failed(ctx, info, p, 0, t, data, "skipped: out of memory", kernel="decode-budget"))
                    continue
                except UsageError as exc:
                    recs.append(failed(ctx, info, p, 0, t, data, f"skipped: {exc}", kernel="decode-budget"))
                    continue
                m["memory_budget"] = budget
                recs.append(record(ctx, info, m, data, kernel="decode-budget"))
                free_memory(ctx)
    add_decode_speedups(recs, DENSE)
    return recs


def add_decode_speedups(recs: list[dict], dense: tuple[str, ...]) -> None:
    """``speedup[d]``: dense provider d's step time / this step time at the same batch and context
    (tokens/s ratio); ``speedup["dense"]``: over the faster dense provider; in the budget rows
    ``throughput_vs_dense``: tokens/s over the best dense tokens/s under the same budget."""
    for kernel in ("decode", "decode-budget"):
        rows = [r for r in recs if r["kernel"] == kernel and r["median_us"]]
        for r in rows:
            if kernel == "decode":
                same = {d["provider"]: d for d in rows if d["provider"] in dense and (d["batch"], d["seq"]) == (r["batch"], r["seq"])}
                for name, d in same.items():
                    if name != r["provider"]:
                        r["speedup"][name] = d["median_us"] / r["median_us"]
                if same:
                    r["speedup"]["dense"] = min(d["median_us"] for d in same.values()) / r["median_us"]
            else:
                best = max((d["tokens_per_s"] for d in rows if d["provider"] in dense and d["seq"] == r["seq"]), default=None)
                if best:
                    r["throughput_vs_dense"] = r["tokens_per_s"] / best


def decode_table(doc: dict[str, Any]) -> str:
    """Markdown: one row per record of a ``bench decode`` document (docs/benchmarks.md)."""
    gen = any(r.get("generate_tokens") for r in doc["records"])
    head = ["provider", "batch", "context", "ms / step", "tokens/s", "× dense", "attention share", "KV GiB", "peak GiB", "peak / (KV + workspace)", "encode µs / token"]
    head += ["generate tokens/s", "generate / step", "encode share of generate"] if gen else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["records"]:
        name = r["provider"] + (" (budget)" if r["kernel"] == "decode-budget" else "")
        if r["median_us"] is None:
            lines.append(f"| {name} | {r['batch']} | {r['seq']} | {r['status']} |" + " |" * (len(head) - 4))
            continue
        sp = r["throughput_vs_dense"] if r["kernel"] == "decode-budget" else r["speedup"].get("dense")

        def f(x, nd=2, scale=1.0):
            return "–" if x is None else f"{x * scale:.{nd}f}"

        lines.append("| " + " | ".join([
            name, str(r["batch"]), str(r["seq"]), f(r["median_us"], 2, 1e-3), f(r["tokens_per_s"], 0), f(sp) if isinstance(sp, float) else "–",
            f(r["attention_share"], 0, 100) + "%", f(r["stored_bytes"], 2, 1 / 2**30), f(r["peak_bytes"], 2, 1 / 2**30),
            f(r["peak_over_stated"]), f(r["encode_us_per_token"], 1)]
            + ([f(r.get("generate_tokens_per_s"), 0), f(r.get("generate_vs_step")), f(r.get("generate_encode_share"), 1, 100) + "%"] if gen else [])) + " |")
    return "\n".join(lines)
