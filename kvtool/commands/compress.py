"""``kvtool compress``: encode a capture with one format; ``kvtool decompress``: back to dense."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.core.errors import UsageError
from kvtool.commands._catalog import format_summaries
from kvtool.commands._command import Api, Outcome, add_commands, declare
from kvtool.commands._complete import complete_evict, complete_format
from kvtool.commands._common import (
    DevicesOpt,
    CaptureArg,
    ForceOpt,
    LayersOpt,
    console,
    example_epilog,
    fmt_bytes,
    make_table,
    params_text,
    show,
)
from kvtool.core.progress import Progress

ORDER = 40
HELDOUT = 64  # a capture file's held-out split by default: its last tokens stay dense, their queries are verify's test set
SHORT_HELP = "Encode a capture with one of the registered formats (see --help)"

# Options shared by the formats: each one given is passed to the format's parameter of the same name
# (dashes -> underscores); a format without that parameter refuses it with a clear message.
FLOAT_OPTS = ("sparsity", "key_sparsity", "value_sparsity", "budget_ratio", "lam")
INT_OPTS = ("dense_window", "bits", "group", "sinks", "keep_top", "page_size", "budget", "recent", "window", "pool", "residual")
STR_OPTS = ("method", "center", "score", "evict", "prune")


def print_report(report: dict[str, Any]) -> None:
    params = params_text(report["params"])
    show("[bold]{}[/bold] ({})  layers {}, {} tokens compressed, {} held out dense", report["format"], params,
         len(report["layers"]), report["prefix_tokens"], report["heldout"])
    rows = [(part, fmt_bytes(n), f"{100.0 * n / report['dense_bytes']:.2f}") for part, n in report["bytes_by_part"].items()]
    rows.append(("total", fmt_bytes(report["stored_bytes"]), f"{100 * report['storage_ratio']:.2f}"))
    rows.append(("dense", fmt_bytes(report["dense_bytes"]), "100.00"))
    console.print(make_table("bytes (share of the dense keys+values)", ["part", "bytes", "of dense %"], rows))
    details = report.get("details") or {}
    flat = {k: v for k, v in details.items() if not isinstance(v, (dict, list))}
    if flat:
        console.print(make_table("details", ["what", "value"], list(flat.items())))
    if "output" in report:
        show("wrote {} ({})", report["output"], fmt_bytes(report["file_bytes"]))


def compress_help() -> str:
    names = ", ".join(f"{n} ({summary})" for n, summary in format_summaries().items())
    return (f"Compress a capture with one format and write a compressed file.\n\nFormats: {names}.\n\n"
            "Every option below applies to the formats that have a parameter of that name; NAME:key=value,... in "
            "--format and repeated --param key=value set any parameter. --evict and --prune put steps in front of the format "
            "(or chain them in --format: snapkv:budget=256+per-token:k=0.5,v=0.7+quant:bits=4). The last --heldout tokens (default "
            f"{HELDOUT}) stay dense and are reported apart: their queries are what `kvtool verify` scores; --heldout 0 compresses every token.")


@declare(
    "compress",
    help=compress_help,
    epilog=example_epilog(
        "kvtool compress cap.safetensors --format bitmap --sparsity 0.7 -o cap.bitmap.safetensors",
        "kvtool compress cap.safetensors --format quant:bits=4 --json",
        "kvtool compress cap.safetensors --evict snapkv:budget=256 --prune per-token:k=0.5,v=0.7 --format quant:bits=4",
        "kvtool compress cap.safetensors --plan plan.json -o cap.plan.safetensors   # plan from kvtool recommend",
    ),
    render=lambda outcome: print_report(outcome.data),
)
def compress(
    capture: CaptureArg,
    format: Annotated[str, typer.Option("--format", "-F", help="Format name, optionally with parameters: NAME[:key=value,...].", autocompletion=complete_format), Api(positional=True)] = "dense",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output file (default: CAPTURE.FORMAT.safetensors).", dir_okay=False), Api(positional=True)] = None,
    sparsity: Annotated[float | None, typer.Option(help="Fraction of elements pruned, keys and values (bitmap).")] = None,
    key_sparsity: Annotated[float | None, typer.Option(help="Key sparsity (overrides --sparsity).")] = None,
    value_sparsity: Annotated[float | None, typer.Option(help="Value sparsity (overrides --sparsity).")] = None,
    method: Annotated[str | None, typer.Option(help="Pruning method (see `kvtool prune --help`).")] = None,
    dense_window: Annotated[int | None, typer.Option(help="Most recent tokens kept dense inside the format.")] = None,
    bits: Annotated[int | None, typer.Option(help="Quantisation bits (signvq; quant and bitmapq: 2|4|8).")] = None,
    group: Annotated[int | None, typer.Option(help="Elements per scale/zero point (signvq, quant, bitmapq; default 32).")] = None,
    center: Annotated[str | None, typer.Option(help="Key centring before sign codes: mean|median (signvq).")] = None,
    sinks: Annotated[int | None, typer.Option(help="First tokens kept in full precision.")] = None,
    keep_top: Annotated[int | None, typer.Option(help="Tokens kept in full precision by the last query's score (signvq).")] = None,
    page_size: Annotated[int | None, typer.Option(help="Tokens per page (pagestat).")] = None,
    score: Annotated[str | None, typer.Option(help="Page score: unique|quest|mean (pagestat).")] = None,
    budget: Annotated[int | None, typer.Option(help="Token budget (pagestat, snapstream, signvq top-k).")] = None,
    budget_ratio: Annotated[float | None, typer.Option(help="Token budget as a fraction of the tokens.")] = None,
    lam: Annotated[float | None, typer.Option("--lam", help="UNIQUE's lambda (pagestat).")] = None,
    recent: Annotated[int | None, typer.Option(help="Recent tokens in the ring buffer (snapstream).")] = None,
    window: Annotated[int | None, typer.Option(help="Observation window of queries (snapstream).")] = None,
    pool: Annotated[int | None, typer.Option(help="Pooling kernel along tokens (snapstream).")] = None,
    residual: Annotated[int | None, typer.Option(help="Full-precision residual tokens (quant, bitmapq; default 32).")] = None,
    evict: Annotated[str | None, typer.Option(help="Eviction step in front of the format: POLICY:budget=N[,sinks=,recent=,window=,pool=], policy snapkv|streaming.", autocompletion=complete_evict)] = None,
    prune: Annotated[str | None, typer.Option(help="Pruning step after eviction: METHOD:k=KEY_SPARSITY,v=VALUE_SPARSITY[,window=N]; with --format quant it stores as bitmapq.")] = None,
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help="Any format parameter as key=value (repeatable).")] = None,
    heldout: Annotated[int | None, typer.Option(help=f"Last tokens kept dense and out of the compressor's sight: their queries are what `kvtool verify` scores (default: {HELDOUT} for a capture file; 0, every token compressed, for kvtool.compress of a cache in memory).", min=0, show_default=False)] = None,
    plan: Annotated[Path | None, typer.Option("--plan", help="A plan file (kvtool recommend writes one): a format per layer / KV head; the file's format is then mixed.", dir_okay=False)] = None,
    layers: LayersOpt = None,
    device: DevicesOpt = "auto",
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.formats.files import compress_file  # deferred: start-up time

    local = dict(locals())
    if plan is not None and (format != "dense" or any(local.get(k) is not None for k in FLOAT_OPTS + INT_OPTS + STR_OPTS) or param):
        raise UsageError("--plan sets every layer's format; drop --format and the format options")
    options: dict[str, Any] = {k: local[k] for k in FLOAT_OPTS + INT_OPTS + STR_OPTS if local.get(k) is not None}
    for item in param or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"--param {item!r}: write key=value")
        options[key.strip()] = value.strip()
    heldout = HELDOUT if heldout is None else heldout
    _, _, report = compress_file(capture, format, output, options, heldout, layers, force, progress=progress, device=device, plan=plan)
    return Outcome(report, input=capture, output=report.get("output"))


def print_decompressed(outcome: Outcome) -> None:
    r = outcome.data
    show("decoded {} -> {} ({} tokens, {} layers)", r["format"], outcome.output, r["tokens"], len(r["layers"]))


@declare(
    "decompress",
    short_help="Decode a compressed file back to a dense capture",
    help="Decode a compressed file back to a capture-schema file (the dense tensors the format represents).",
    epilog=example_epilog("kvtool decompress cap.bitmap.safetensors -o cap.pruned.safetensors"),
    render=print_decompressed,
)
def decompress(
    compressed: Annotated[Path, typer.Argument(help="A compressed file made by `kvtool compress`.", show_default=False)],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output capture file (default: NAME.dense.safetensors).", dir_okay=False), Api(positional=True)] = None,
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.formats.files import decompress_file  # deferred: start-up time

    cache, path = decompress_file(compressed, output, force)
    result = {"format": cache.info["format"], "tokens": cache.num_tokens, "layers": [{"layer": i} for i in cache.layer_indices]}
    return Outcome(result, input=compressed, output=path)


def register(app: typer.Typer) -> None:
    add_commands(app, compress, decompress)
