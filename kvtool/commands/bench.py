"""``kvtool bench``: time the decode kernels against cuBLAS, torch SDPA and FlashInfer on the GPU.

One sub-command per kernel family, all with the same options; every baseline is timed in the same run
on the same tensors, and every kernel is checked against its reference before it is timed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from kvtool.commands._catalog import bench_suite_catalog, bench_suite_summaries
from kvtool.commands._common import (
    DebugOpt,
    ForceOpt,
    JsonOpt,
    QuietOpt,
    console,
    deprecated,
    emit_json,
    err_console,
    example_epilog,
    kvtool_command,
    library_progress,
    make_table,
    quiet_enabled,
    show,
    to_json_text,
)

ORDER = 70
SHORT_HELP = "Time the GPU kernels against cuBLAS and FlashInfer"

REPORT_HELP = ("Markdown tables (device, versions, date, then one row per record) from `kvtool bench -o` JSON files, "
               "for docs/benchmarks.md; every cell comes from a record of the files.")
CPU_EXAMPLE = "TRITON_INTERPRET=1 kvtool bench {suite} --model-shape custom --heads 4 --kv-heads 2 --head-dim 64 --batch 1 --seq 256"
CPU_EXTRA = {"lut": " --budget 64", "pages": " --budget 64"}  # a budget below the CPU example's 256 tokens

def print_result(doc: dict[str, Any]) -> None:
    env = doc["env"]
    copy = f"{env['copy_gbps']:.0f} GB/s (read-only {env['read_gbps']:.0f})" if env.get("copy_gbps") else "not measured"
    v = env["versions"]
    show("[bold]{}[/bold]  copy bandwidth {}  torch {}  triton {}  CUDA {}  flashinfer {}  cold L2 {}", env["device"], copy, v["torch"],
         v["triton"], v["cuda"], v["flashinfer"], "on" if env["cold_l2"] else "off")
    for note in env.get("notes", []):
        show("[yellow]note:[/yellow] {}", note)
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
        sp = [f"{x:.2f}" if isinstance(x, float) else ("" if x is None else str(x)) for x in sp]
        rows.append(([r["kernel"]] if many else []) + [r["provider"], r["batch"], r["seq"], param, r["median_us"], spread,
                     r.get("floor_us"), r["bandwidth_gbps"], frac, r["rel_err"], r["status"]] + sp)
    console.print(make_table(f"kvtool bench {doc['subcommand']}", cols, rows))
    if not env["timing_valid"]:
        console.print("[yellow]timings above are meaningless (CPU interpreter run)[/yellow]")


class LazyBenchGroup(TyperGroup):
    """``kvtool bench``: its subcommands (one per suite, which import torch and the kernels) are built
    the first time this group is listed or entered, so ``kvtool --help`` stays fast."""

    _real: click.Group | None = None
    _listing = False

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # the listing needs names and summaries only: read them from the suites' source
        LazyBenchGroup._listing = True
        try:
            return super().format_help(ctx, formatter)
        finally:
            LazyBenchGroup._listing = False

    def _commands(self) -> click.Group:
        if LazyBenchGroup._real is None:
            real = typer.Typer(rich_markup_mode="rich")
            # names, summaries and examples read from the suites' source: --help needs no torch
            # (a suite runs by its name, imported when it runs)
            catalog = bench_suite_catalog()
            if catalog is None:
                from kvtool.bench.suites import load_suites  # deferred: start-up time

                suites: list[Any] = list(load_suites().values())
            else:
                suites = [SimpleNamespace(name=n, summary=summary, example=example) for n, (summary, example) in catalog.items()]
            for suite in suites:
                if suite.name == "decode":  # a model, not kernels: options of its own
                    _add_decode(real, suite)
                else:
                    _add_subcommand(real, suite)
            _add_report(real)
            LazyBenchGroup._real = typer.main.get_group(real)
        return LazyBenchGroup._real

    def list_commands(self, ctx: click.Context) -> list[str]:
        if LazyBenchGroup._listing and LazyBenchGroup._real is None:
            return sorted([*bench_suite_summaries(), "report"])
        return self._commands().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if LazyBenchGroup._listing and LazyBenchGroup._real is None:
            summaries = {**bench_suite_summaries(), "report": REPORT_HELP}
            if cmd_name not in summaries:
                return None
            return click.Command(cmd_name, help=summaries[cmd_name], short_help=summaries[cmd_name].split(". ")[0].rstrip("."))
        return self._commands().get_command(ctx, cmd_name)


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(
        name="bench",
        cls=LazyBenchGroup,
        help="Benchmark the decode kernels against cuBLAS, torch SDPA and FlashInfer on a CUDA GPU "
             "(median of many runs, L2 flushed between runs, copy bandwidth measured in the same run).",
        no_args_is_help=True,
        rich_markup_mode="rich",
        epilog=example_epilog("kvtool bench dense --model-shape llama3-8b --batch 1,8 --seq 4k,32k -o bench-dense.json",
                              "kvtool bench attention --model-shape llama3-8b --batch 8 --seq 4096,32768 --sparsity 0.7 --json",
                              CPU_EXAMPLE.format(suite="dense")),
    )
    app.add_typer(bench_app, name="bench")


def _add_subcommand(bench_app: typer.Typer, suite: Any) -> None:
    sub = suite.name

    @bench_app.command(sub, help=suite.summary, epilog=example_epilog(suite.example, CPU_EXAMPLE.format(suite=sub) + CPU_EXTRA.get(sub, "")))
    @kvtool_command
    def command(
        model_shape: Annotated[str, typer.Option("--model-shape", help="llama3-8b (32 heads, 8 KV, 128), llama3-70b (64, 8, 128), llama2-7b (32, 32, 128), smollm2 (9, 3, 64), tiny (4, 2, 16) or custom.")] = "llama3-8b",
        heads: Annotated[int | None, typer.Option("--heads", help="Query heads (custom shape, or override).")] = None,
        kv_heads: Annotated[int | None, typer.Option("--kv-heads", help="KV heads (custom shape, or override).")] = None,
        head_dim: Annotated[int | None, typer.Option("--head-dim", help="Head dimension (custom shape, or override).")] = None,
        batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "1,8",
        seq: Annotated[str, typer.Option("--seq", help="Sequence lengths, comma-separated (k = 1024): 4k,32k,128k.")] = "4k,32k",
        sparsity: Annotated[str, typer.Option("--sparsity", help="Bitmap sparsities (spmv, attention, compress).")] = "0.5,0.7",
        budget: Annotated[str, typer.Option("--budget", help="Token budgets (lut, pages).")] = "2048",
        k: Annotated[str | None, typer.Option("--top-k", help="Heads computed out of H (heads; default H/2).")] = None,
        k_old: Annotated[str | None, typer.Option("--k", hidden=True, help="Deprecated name of --top-k.")] = None,
        dtype: Annotated[str, typer.Option("--dtype", help="fp16 (float16) or bf16 (bfloat16).")] = "fp16",
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
        output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the records as JSON to this file (the table still prints).", dir_okay=False)] = None,
        plot: Annotated[Path | None, typer.Option("--plot-output", help="Write a figure (PNG/PDF/SVG): time vs seq per provider, speedup vs sparsity.", dir_okay=False)] = None,
        plot_old: Annotated[Path | None, typer.Option("--plot", hidden=True, help="Deprecated name of --plot-output.", dir_okay=False)] = None,
        force: ForceOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        from kvtool.bench.runner import build_context, run_suite  # deferred: start-up time
        from kvtool.core import io  # deferred: start-up time

        if k_old is not None:
            deprecated("--k", "--top-k")
            k = k if k is not None else k_old
        if plot_old is not None:
            deprecated("--plot", "--plot-output")
            plot = plot or plot_old
        if output is not None:
            io.check_output(output, force)
        if plot is not None:
            io.check_output(plot, force)
        with library_progress(json_out or quiet) as sink:  # each timed provider and configuration is a stage
            ctx = build_context(sub, model_shape, heads, kv_heads, head_dim, batch, seq, sparsity, budget, k, dtype, capture, layer,
                                cold_l2, warmup_ms, rep_ms, page_size, window, host_overhead, cuda_graph, step=sink.stage, backend=backend)
            doc = run_suite(sub, ctx)
        if output is not None:
            io.atomic_write_text(output, to_json_text(doc), force=force)
        if plot is not None:
            from kvtool.bench.plots import plot_records  # deferred: matplotlib loads only with --plot-output

            plot_records(doc, plot, force=force)
        if json_out:
            emit_json(doc, input=str(capture) if capture else None, output=output)
        else:
            print_result(doc)
            for path in (output, plot):
                if path is not None:
                    show("wrote {}", path)
        if any(r["status"] == "wrong" for r in doc["records"]):
            err_console.print("[red]error:[/red] a kernel failed its correctness check (status 'wrong'); its timing was skipped")
            raise typer.Exit(1)


DECODE_CPU_EXAMPLE = "TRITON_INTERPRET=1 kvtool bench decode --model-shape tiny --batch 1 --seq 256 --formats bitmap:sparsity=0.7 --generate 16 --encode-repeats 1"


def print_decode(doc: dict[str, Any]) -> None:
    env = doc["env"]
    v = env["versions"]
    show("[bold]{}[/bold]  torch {}  CUDA {}  flashinfer {}", env["device"], v["torch"], v["cuda"], v["flashinfer"])
    for note in env.get("notes", []):
        show("[yellow]note:[/yellow] {}", note)
    gen = any(r.get("generate_tokens") for r in doc["records"])
    cols = (["provider", "batch", "context", "ms/step", "tokens/s", "x dense", "attn share", "KV GiB", "peak GiB", "peak/stated", "encode us/tok"]
            + (["generate tok/s", "gen/step", "encode share"] if gen else []) + ["method", "status"])
    rows = []
    for r in doc["records"]:
        sp = r.get("throughput_vs_dense") if r["kernel"] == "decode-budget" else r["speedup"].get("dense")
        gib = (lambda x: None if x is None else x / 2**30)
        rows.append([r["provider"] + (" (budget)" if r["kernel"] == "decode-budget" else ""), r["batch"], r["seq"],
                     None if r["median_us"] is None else r["median_us"] / 1e3, r.get("tokens_per_s"), sp if isinstance(sp, float) else None,
                     None if r.get("attention_share") is None else f"{100 * r['attention_share']:.0f}%", gib(r.get("stored_bytes")),
                     gib(r.get("peak_bytes")), r.get("peak_over_stated"), r.get("encode_us_per_token")]
                    + ([r.get("generate_tokens_per_s"), r.get("generate_vs_step"),
                        None if r.get("generate_encode_share") is None else f"{100 * r['generate_encode_share']:.1f}%"] if gen else [])
                    + [r.get("method"), r["status"]])
    console.print(make_table("kvtool bench decode", cols, rows))
    if not env["timing_valid"]:
        console.print("[yellow]timings above are meaningless (CPU run)[/yellow]")


def _add_decode(bench_app: typer.Typer, suite: Any) -> None:
    @bench_app.command("decode", help=suite.summary, epilog=example_epilog(
        suite.example, "kvtool bench decode --model-shape llama3-8b --batch 8 --seq 32k --formats bitmap:sparsity=0.7 snapstream:budget=4096 --plan plan.json",
        DECODE_CPU_EXAMPLE))
    @kvtool_command
    def decode(
        model_shape: Annotated[str, typer.Option("--model-shape", help="A named model shape built with seeded random weights on the device: llama3-8b, llama3-70b, llama2-7b, smollm2, tiny.")] = "llama3-8b",
        model: Annotated[str | None, typer.Option("--model", "-m", help="A local Hugging Face folder, a .gguf file or 'embedded' instead of --model-shape.")] = None,
        batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "1,8,32",
        seq: Annotated[str, typer.Option("--seq", help="Cached tokens per sequence, comma-separated (k = 1024).")] = "4k,32k",
        formats: Annotated[list[str] | None, typer.Option("--formats", help="Format specs to decode through (default: bitmap 0.7 / 0.5, KIVI 4 / 2, sign-VQ, pages, snapstream); repeat or give several.")] = None,
        plan: Annotated[list[Path] | None, typer.Option("--plan", help="Plan files (kvtool recommend -o plan.json) to decode through too.", dir_okay=False)] = None,
        memory_budget: Annotated[str | None, typer.Option("--memory-budget", help="A KV-cache budget beside the weights (40GiB): each provider's largest batch that fits it, and its throughput.")] = None,
        budget_only: Annotated[bool, typer.Option("--budget-only", help="Only the --memory-budget runs (the batch sweep is left out; --seq still applies).")] = False,
        runs: Annotated[int, typer.Option("--runs", help="Timed replays of the decode step per configuration.")] = 20,
        generate: Annotated[int, typer.Option("--generate", help="Also time N greedy tokens from the --seq context through the live cache, every block / group encode included, after N untimed ones (first-use kernel compilation): tokens/s and the share spent encoding (0: off).")] = 0,
        encode_repeats: Annotated[int, typer.Option("--encode-repeats", help="Spans of decoding the growth (encode) cost per token is the median of (0: not measured).")] = 5,
        dtype: Annotated[str, typer.Option("--dtype", help="fp16 (float16) or bf16 (bfloat16) for the model and its cache.")] = "fp16",
        output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the records as JSON to this file (the table still prints).", dir_okay=False)] = None,
        plot: Annotated[Path | None, typer.Option("--plot-output", help="Write a figure (PNG/PDF/SVG): tokens/s per provider and batch, and peak memory.", dir_okay=False)] = None,
        force: ForceOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        from kvtool.bench.runner import build_decode_context, run_suite  # deferred: start-up time
        from kvtool.core import io  # deferred: start-up time

        for path in (output, plot):
            if path is not None:
                io.check_output(path, force)
        silent = json_out or quiet_enabled(quiet)
        ctx = build_decode_context(model_shape, model, batch, seq, formats, plan, memory_budget, runs, dtype,
                                   step=(lambda msg: None) if silent else (lambda msg: err_console.print(msg, style="dim", markup=False)),
                                   budget_only=budget_only, generate=generate, encode_repeats=encode_repeats)
        doc = run_suite("decode", ctx)
        if output is not None:
            io.atomic_write_text(output, to_json_text(doc), force=force)
        if plot is not None:
            from kvtool.bench.plots import plot_decode  # deferred: matplotlib loads only with --plot-output

            plot_decode(doc, plot)
        if json_out:
            emit_json(doc, input=model, output=output)
        else:
            print_decode(doc)
            for path in (output, plot):
                if path is not None:
                    show("wrote {}", path)


def _add_report(bench_app: typer.Typer) -> None:
    @bench_app.command(
        "report",
        help=REPORT_HELP,
        epilog=example_epilog("kvtool bench report docs/benchmarks/*.json --summary -o tables.md"),
    )
    @kvtool_command
    def report(
        files: Annotated[list[Path], typer.Argument(help="JSON files written by `kvtool bench ... -o FILE`.", show_default=False)],
        output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the Markdown here instead of stdout.", dir_okay=False)] = None,
        summary: Annotated[bool, typer.Option("--summary", help="Only the kvtool kernels' rows, with their speedups over the primary baselines.")] = False,
        force: ForceOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        from kvtool.bench.tables import markdown  # deferred: start-up time
        from kvtool.bench.runner import read_bench_json  # deferred: start-up time
        from kvtool.core import io  # deferred: start-up time

        text = "\n".join(markdown(read_bench_json(f), summary=summary) for f in files)
        if output is not None:
            io.atomic_write_text(output, text, force=force)
        if json_out:
            emit_json({"markdown": text}, inputs=files, output=output)
        elif output is None:
            sys.stdout.write(text)
        else:
            show("wrote {}", output)
