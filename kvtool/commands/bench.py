"""``kvtool bench``: time the decode kernels against cuBLAS, torch SDPA and FlashInfer on the GPU.

One sub-command per kernel family, all with the same options; every baseline is timed in the same run
on the same tensors, and every kernel is checked against its reference before it is timed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import bench as B
from .. import io
from ..errors import UsageError
from ._common import DebugOpt, ForceOpt, console, err_console, example_epilog, kvtool_command, make_table, to_json_text

ORDER = 70

SUBCOMMANDS = {
    "dense": "The dense decode-attention baselines alone: cuBLAS q·Kᵀ and P·V, torch dense (matmul + softmax), "
             "torch SDPA, FlashInfer single and batched paged decode.",
    "spmv": "Bitmap K·q and P·V products alone vs torch.matmul (cuBLAS) on the dense tensors.",
    "attention": "Whole decode attention: bitmap sparse attention vs dense torch, SDPA and FlashInfer decode.",
    "lut": "Sign-VQ lookup-table scoring vs dense fp16 q·Kᵀ; then top-k + sparse attention vs FlashInfer dense.",
    "pages": "Page criticality + top-k + paged sparse attention vs FlashInfer dense decode.",
    "heads": "Selective head attention at k of H heads vs dense decode.",
    "compress": "Throughput of the bitmap compression kernel (and sign-VQ / page-statistics encoding) vs copy bandwidth.",
}

EXAMPLES = {
    "dense": "kvtool bench dense --model-shape llama3-8b --batch 1,8,32 --seq 4k,32k --json dense.json",
    "spmv": "kvtool bench spmv --batch 8 --seq 32k --sparsity 0.5,0.7",
    "attention": "kvtool bench attention --batch 1,8,32 --seq 4k,32k --sparsity 0.5,0.7 --json att.json --plot att.png",
    "lut": "kvtool bench lut --batch 8 --seq 32k --budget 2048",
    "pages": "kvtool bench pages --batch 8 --seq 128k --budget 2048",
    "heads": "kvtool bench heads --batch 8 --seq 32k --k 16",
    "compress": "kvtool bench compress --batch 8 --seq 32k --sparsity 0.7",
}

CPU_EXAMPLE = "TRITON_INTERPRET=1 kvtool bench dense --model-shape custom --heads 4 --kv-heads 2 --head-dim 64 --batch 1 --seq 256"

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
        if val < 1:
            raise UsageError(f"--{what}: {val} must be at least 1")
        out.append(val)
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
    import torch

    from ..bench_suites import BenchContext

    shape = B.model_shape(model_shape, heads, kv_heads, head_dim)
    if dtype.lower() not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use fp16 or bf16")
    if capture is not None and not Path(capture).is_file():
        raise UsageError(f"--capture {capture}: no such file")
    if page_size < 1 or window < 0:
        raise UsageError("--page-size must be at least 1 and --window at least 0")
    if backend not in ("auto", "triton", "cuda"):
        raise UsageError(f"--backend {backend!r}: use auto, triton or cuda")
    env = B.detect_env(cold_l2=cold_l2)
    ks = parse_int_list(k, "k") if k else [max(1, shape.heads // 2)]
    if any(x > shape.heads for x in ks):
        raise UsageError(f"--k {max(ks)} is more than the {shape.heads} query heads")
    timer = B.Timer(env, warmup_ms=warmup_ms, rep_ms=rep_ms, hide_launch=not host_overhead, cuda_graph=cuda_graph)
    if env.device_type == "cuda":
        env.notes.append("timings include host launch overhead" if host_overhead else "device time: launches queued behind a GPU sleep before each start event")
    return BenchContext(
        env=env, timer=timer, shape=shape, batches=parse_int_list(batch, "batch"), seqs=parse_int_list(seq, "seq"),
        dtype=getattr(torch, DTYPES[dtype.lower()]), sparsities=parse_float_list(sparsity, "sparsity"),
        budgets=parse_int_list(budget, "budget"), ks=ks, capture=capture, layer=layer, page_size=page_size,
        window=window, step=step or (lambda msg: None), backend=backend,
    )


def run_suite(sub: str, ctx) -> dict[str, Any]:
    """Run one subcommand's suite; the result document written by --json."""
    from ..bench_suites import SUITES

    if sub not in SUITES:
        raise B.BenchUnavailable(f"kvtool bench {sub}: no suite for it in this checkout")
    suite, primary = SUITES[sub]
    records = suite(ctx)
    if ctx.timer.graph_errors:
        ctx.env.notes.append(f"{len(ctx.timer.graph_errors)} provider(s) could not be captured in a CUDA graph and were timed "
                             f"as launches (method 'stream'); first reason: {ctx.timer.graph_errors[0]}")
    import datetime

    return {
        "kvtool_bench": 1,
        "subcommand": sub,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "kvtool " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(("kvtool", "__main__.py")) else None,
        "env": ctx.env.to_dict(),
        "shape": _shape_of(ctx, records),
        "primary_baselines": list(primary),
        "records": records,
    }


def _shape_of(ctx, records: list[dict]) -> dict[str, Any]:
    """The attention shape timed: the model shape, or with --capture the captured model's."""
    if ctx.capture is not None and records:
        r = records[0]
        return {"name": r["data"], "heads": r["heads"], "kv_heads": r["kv_heads"], "head_dim": r["head_dim"]}
    return {"name": ctx.shape.name, "heads": ctx.shape.heads, "kv_heads": ctx.shape.kv_heads, "head_dim": ctx.shape.head_dim}


def print_result(doc: dict[str, Any]) -> None:
    env = doc["env"]
    copy = f"{env['copy_gbps']:.0f} GB/s (read-only {env['read_gbps']:.0f})" if env.get("copy_gbps") else "not measured"
    v = env["versions"]
    console.print(f"[bold]{env['device']}[/bold]  copy bandwidth {copy}  torch {v['torch']}  triton {v['triton']}  CUDA {v['cuda']}  "
                  f"flashinfer {v['flashinfer']}  cold L2 {'on' if env['cold_l2'] else 'off'}")
    for note in env.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")
    recs = doc["records"]
    base_names = [n for n in doc.get("primary_baselines", []) if any(n in r["speedup"] for r in recs)]
    many = len({r["kernel"] for r in recs}) > 1
    cols = (["kernel"] if many else []) + ["provider", "batch", "seq", "param", "median µs", "p10-p90", "floor µs", "GB/s", "%copy", "rel err", "status"] + [f"x{n}" for n in base_names]
    rows = []
    for r in recs:
        param = next((f"{n}={r[n]}" for n in ("sparsity", "budget", "k") if r[n] is not None), "")
        spread = f"{r['p10_us']:.0f}-{r['p90_us']:.0f}" if r["median_us"] is not None else ""
        frac = f"{100 * r['bandwidth_fraction']:.0f}%" if r["bandwidth_fraction"] is not None else ""
        sp = [r["speedup"].get(n) for n in base_names]
        sp = [f"{x:.2f}" if isinstance(x, float) else ("" if x is None else str(x)[:13]) for x in sp]
        rows.append(([r["kernel"]] if many else []) + [r["provider"], r["batch"], r["seq"], param, r["median_us"], spread,
                     r.get("floor_us"), r["bandwidth_gbps"], frac, r["rel_err"], r["status"][:32]] + sp)
    console.print(make_table(f"kvtool bench {doc['subcommand']}", cols, rows))
    if not env["timing_valid"]:
        console.print("[yellow]timings above are meaningless (CPU interpreter run)[/yellow]")


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(
        name="bench",
        help="Benchmark the decode kernels against cuBLAS, torch SDPA and FlashInfer on a CUDA GPU "
             "(median of many runs, L2 flushed between runs, copy bandwidth measured in the same run).",
        no_args_is_help=True,
        rich_markup_mode="rich",
        epilog=example_epilog(EXAMPLES["dense"], EXAMPLES["attention"], CPU_EXAMPLE),
    )
    for sub, summary in SUBCOMMANDS.items():
        _add_subcommand(bench_app, sub, summary)
    app.add_typer(bench_app, name="bench")


def _add_subcommand(bench_app: typer.Typer, sub: str, summary: str) -> None:
    @bench_app.command(sub, help=summary, epilog=example_epilog(EXAMPLES[sub], CPU_EXAMPLE))
    @kvtool_command
    def command(
        model_shape: Annotated[str, typer.Option("--model-shape", help="llama3-8b (32 heads, 8 KV, 128), llama2-7b (32, 32, 128), smollm2 (9, 3, 64) or custom.")] = "llama3-8b",
        heads: Annotated[int | None, typer.Option("--heads", help="Query heads (custom shape, or override).")] = None,
        kv_heads: Annotated[int | None, typer.Option("--kv-heads", help="KV heads (custom shape, or override).")] = None,
        head_dim: Annotated[int | None, typer.Option("--head-dim", help="Head dimension (custom shape, or override).")] = None,
        batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "1,8",
        seq: Annotated[str, typer.Option("--seq", help="Sequence lengths, comma-separated (k = 1024): 4k,32k,128k.")] = "4k,32k",
        sparsity: Annotated[str, typer.Option("--sparsity", help="Bitmap sparsities (spmv, attention, compress).")] = "0.5,0.7",
        budget: Annotated[str, typer.Option("--budget", help="Token budgets (lut, pages).")] = "2048",
        k: Annotated[str | None, typer.Option("--k", help="Heads computed out of H (heads; default H/2).")] = None,
        dtype: Annotated[str, typer.Option("--dtype", help="fp16 or bf16.")] = "fp16",
        capture: Annotated[Path | None, typer.Option("--capture", help="Time on a capture file's real tensors (one layer, tiled to --seq and --batch).", dir_okay=False)] = None,
        layer: Annotated[int | None, typer.Option("--layer", help="Capture layer to use (default: the first captured).")] = None,
        cold_l2: Annotated[bool, typer.Option("--cold-l2/--no-cold-l2", help="Overwrite a buffer larger than L2 before each timed run.")] = True,
        host_overhead: Annotated[bool, typer.Option("--host-overhead/--device-time", help="Include Python and launch overhead in the timings (default: device time only).")] = False,
        cuda_graph: Annotated[bool, typer.Option("--cuda-graph", help="Time CUDA-graph replays of each provider (multi-kernel steps without host syncs); falls back to launches when capture fails.")] = False,
        warmup_ms: Annotated[float, typer.Option("--warmup-ms", help="Warm-up time per provider.")] = 25.0,
        rep_ms: Annotated[float, typer.Option("--rep-ms", help="Timed kernel time per provider (10 to 500 runs).")] = 200.0,
        page_size: Annotated[int, typer.Option("--page-size", help="Page size of the paged layouts (FlashInfer, pages).")] = 16,
        window: Annotated[int, typer.Option("--window", help="Dense local window of the sparse formats (tokens).")] = 32,
        backend: Annotated[str, typer.Option("--backend", help="Bitmap attention backend: auto (cuda for 16-bit CUDA tensors), triton or cuda (built on first use).")] = "auto",
        json_path: Annotated[str | None, typer.Option("--json", help="Write the records as JSON to this path ('-' for stdout).")] = None,
        plot: Annotated[Path | None, typer.Option("--plot", help="Write a figure (PNG/PDF/SVG): time vs seq per provider, speedup vs sparsity.", dir_okay=False)] = None,
        force: ForceOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        if json_path and json_path != "-":
            io.check_output(json_path, force)
        if plot is not None:
            io.check_output(plot, force)
        quiet = json_path == "-"
        ctx = build_context(sub, model_shape, heads, kv_heads, head_dim, batch, seq, sparsity, budget, k, dtype, capture, layer,
                            cold_l2, warmup_ms, rep_ms, page_size, window, host_overhead, cuda_graph,
                            step=(lambda msg: None) if quiet else (lambda msg: err_console.print(f"[dim]{msg}[/dim]")), backend=backend)
        doc = run_suite(sub, ctx)
        if json_path == "-":
            sys.stdout.write(to_json_text(doc))
        else:
            print_result(doc)
            if json_path:
                io.atomic_write_text(json_path, to_json_text(doc), force=force)
                console.print(f"wrote {json_path}")
        if plot is not None:
            from ..bench_plots import plot_records

            plot_records(doc, plot)
            if json_path != "-":
                console.print(f"wrote {plot}")
        if any(r["status"] == "wrong" for r in doc["records"]):
            err_console.print("[red]error:[/red] a kernel failed its correctness check (status 'wrong'); its timing was skipped")
            raise typer.Exit(1)
