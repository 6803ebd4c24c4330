"""``kvtool export``: a kvtool file to transformers, FlashInfer/vLLM pages, numpy, dense, csv or json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands._command import Api, Outcome, add_commands, declare
from kvtool.commands._common import (
    ForceOpt,
    example_epilog,
    fmt_bytes,
    show,
)
from kvtool.core.progress import Progress

ORDER = 60
SHORT_HELP = "Export to transformers caches, paged layouts, numpy, tables"

# kvtool.export.convert.TARGETS, named here so that --help needs no torch (tests/test_cli.py checks)
TARGET_NAMES = ("hf", "paged", "npz", "dense", "csv", "json")


def print_exported(outcome: Outcome) -> None:
    report = outcome.data
    detail = {
        "hf": lambda r: f"{r['mode']} cache of {r['tokens']} tokens" + {
            "dense": "",
            "attend": f" ({r['format']} prefix of {r.get('prefix_tokens')} tokens attended through kvtool's attention function)",
            "ring": f" ({r['format']} prefix of {r.get('prefix_tokens')} tokens; later tokens go through its ring buffer)",
        }[r["mode"]],
        "paged": lambda r: (f"{r['num_pages']} pages of {r['page_size']} tokens, {r['layout']}, sequence lengths {r['seq_lens']}, {len(r['layers'])} layers"
                            if "next_position" not in r else
                            f"{r['num_pages']} pages of {r['page_size']} tokens, {r['layout']}, {len(r['layers'])} layers keeping "
                            f"{min(x['seq_len'] for x in r['layers'])}..{max(x['seq_len'] for x in r['layers'])} tokens (a page table per layer; next position {r['next_position']})"),
        "npz": lambda r: f"{len(r['layers'])} layers, {r['tokens']} tokens",
        "dense": lambda r: f"{len(r['layers'])} layers, {r['tokens']} tokens",
        "csv": lambda r: f"{r['rows']} rows from {r['table']}",
        "json": lambda r: f"{r['rows']} rows from {r['table']}",
    }[report["to"]](report)
    show("wrote {} ({}): --to {}, {}", report["output"], fmt_bytes(report["file_bytes"]), report["to"], detail)



@declare(
    "export",
    help="Export a kvtool file to what other tools read.\n\n"
    "hf: a file `kvtool.to_hf_cache(path, model)` turns into a transformers cache for model.generate "
    "(lossy formats decoded; selection formats run through kvtool's attention function; every layer needed). "
    "paged: FlashInfer/vLLM pages of --page-size tokens (NHD or HND) with the page table (indptr, indices, "
    "last_page_len; int32). npz: numpy arrays. dense: the decoded capture. csv/json: the table of a JSON result "
    "(kvtool stats/eval --json) or of a kvtool file's tensors.",
    epilog=example_epilog(
        "kvtool export cap.safetensors --to hf -o cap.hf.safetensors",
        "kvtool export cap.bitmap.safetensors --to paged --page-size 16 --layout NHD",
        "kvtool export cap.safetensors --to npz",
        "kvtool export eval.json --to csv -o eval.csv",
    ),
    render=print_exported,
)
def export(
    source: Annotated[Path, typer.Argument(help="A capture, a compressed file, or (for csv/json) a JSON result.", show_default=False)],
    to: Annotated[str, typer.Option("--to", "-t", help=f"Target: {', '.join(TARGET_NAMES)}.", show_default=False), Api(positional=True)],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output file (default: next to the input, e.g. NAME.paged.safetensors).", dir_okay=False), Api(positional=True)] = None,
    page_size: Annotated[int, typer.Option("--page-size", help="Tokens per page (paged).")] = 16,
    layout: Annotated[str, typer.Option("--layout", help="Page layout (paged): NHD = pages x page x heads x dim, HND = pages x heads x page x dim.")] = "NHD",
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.export.convert import export_file  # deferred: start-up time

    report = export_file(source, to.lower(), output, page_size=page_size, layout=layout, force=force)
    return Outcome(report, input=source, output=report.get("output"))

def register(app: typer.Typer) -> None:
    add_commands(app, export)
