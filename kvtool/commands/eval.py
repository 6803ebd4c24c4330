"""``kvtool eval``: sweep formats and parameters over captures; table, JSON, CSV and frontier plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.core.errors import UsageError
from kvtool.analysis.fidelity import (
    BACKENDS,
)
from kvtool.analysis.evaluate import run_eval
from kvtool.core.placement import DEVICE_HELP
from kvtool.formats.base import FORMATS
from kvtool.analysis.sweep import METRICS
from kvtool.commands._common import (
    DebugOpt,
    JsonOpt,
    console,
    debug_enabled,
    emit_json,
    example_epilog,
    kvtool_command,
    make_table,
    library_progress,
)
from kvtool.formats import load_all

ORDER = 55
SHORT_HELP = "Sweep formats and parameters; fidelity vs bytes frontier"

def split_inputs(items: list[str], formats: list[str]) -> tuple[list[Path], list[str]]:
    """Positional arguments are captures; one that is not a file but names a registered format (the
    tail of ``--formats a b c``) is a sweep spec."""
    load_all()
    captures: list[Path] = []
    specs = list(formats)
    for item in items:
        name = item.partition(":")[0]
        if not Path(item).exists() and (name in FORMATS or ":" in item and "=" in item):
            specs.append(item)
        else:
            captures.append(Path(item))
    if not captures:
        raise UsageError("give at least one capture file")
    for c in captures:
        if not c.exists():
            raise UsageError(f"capture {c}: no such file")
    return captures, specs


def _pct(v: Any) -> Any:
    return None if v is None else 100.0 * v


def print_results(result: dict[str, Any]) -> None:
    rows = result["rows"]
    multi = len({r["capture"] for r in rows}) > 1
    cols = (["capture"] if multi else []) + ["format", "parameters", "stored %", "traffic %", "rel L2", "cosine", "recall", "NLL +", "agreement"]

    def cells(r: dict[str, Any]) -> list[Any]:
        return ([Path(r["capture"]).name] if multi else []) + [
            r["format"], r["params_text"], _pct(r.get("storage_ratio")), _pct(r.get("traffic_ratio")), r.get("rel_l2"),
            r.get("cosine"), r.get("recall"), r.get("nll_increase"), r.get("agreement"),
        ]

    sweep = [r for r in rows if r.get("comparison") is None and not r.get("skipped")]
    if any(r.get("relative_nll_increase_mean") is not None for r in rows):
        n = max(len(r.get("cases", [])) for r in rows)
        cols = cols + [f"NLL + mean [95%], {n} texts", "top-1 mean [95%]"]
        plain = cells

        def cells(r: dict[str, Any]) -> list[Any]:  # noqa: F811
            if r.get("relative_nll_increase_mean") is None:
                return plain(r) + [None, None]
            return plain(r) + [f"{100 * r['relative_nll_increase_mean']:+.2f}% [{100 * r['relative_nll_increase_lo']:+.2f}, {100 * r['relative_nll_increase_hi']:+.2f}]",
                               f"{r['agreement_mean']:.3f} [{r['agreement_lo']:.3f}, {r['agreement_hi']:.3f}]"]
    if sweep:
        console.print(make_table("sweep (attention on held-out queries; model on the continuation)", cols, [cells(r) for r in sweep]))
    paper = [r for r in rows if r.get("comparison") is not None and not r.get("skipped")]
    pcols = (["capture"] if multi else []) + ["variant", "stored %", "rel L2", "cosine", "recall", "NLL +", "agreement"]
    for comparison in dict.fromkeys(r["comparison"] for r in paper):
        prow = [([Path(r["capture"]).name] if multi else []) + [r["label"], _pct(r.get("storage_ratio")), r.get("rel_l2"), r.get("cosine"), r.get("recall"), r.get("nll_increase"), r.get("agreement")]
                for r in paper if r["comparison"] == comparison]
        console.print(make_table(comparison, pcols, prow))
    absent = sorted({r["format"] for r in rows if r.get("skipped", "").endswith("is not in this kvtool")})
    if absent:
        n = sum(1 for r in rows if r["format"] in absent)
        console.print(f"skipped {n} points of formats not in this kvtool: {', '.join(absent)}")
    skipped = [r for r in rows if r.get("skipped") and r["format"] not in absent]
    if skipped:
        console.print(make_table("skipped points", ["format", "parameters", "why"], [(r["format"], r["params_text"], r["skipped"]) for r in skipped]))
    if result["resumed"]:
        console.print(f"resumed: {result['resumed']} finished points were read from {result['files']['json']}, not recomputed")
    console.print("wrote " + ", ".join(v for v in result["files"].values()))


def register(app: typer.Typer) -> None:
    @app.command(
        "eval",
        help="Sweep formats and parameters over one or more captures: storage and traffic ratio, attention-output "
        "error and recall on held-out queries, and (with the model) NLL increase and next-token agreement. Writes "
        "eval.json, eval.csv and the compression-vs-fidelity frontier plot; a rerun resumes finished points. "
        "Sweeps: NAME:key=v1,v2,...; without --formats every registered format is swept with default values, "
        "plus the paper comparison rows.",
        epilog=example_epilog(
            "kvtool eval cap.safetensors",
            "kvtool eval cap.safetensors --formats 'bitmap:sparsity=0.5,0.7,0.9' 'signvq:bits=2,4' --no-paper",
            "kvtool eval cap.safetensors --formats 'pagestat:budget=128,512,score=unique,quest' --metric recall --x traffic --json",
        ),
    )
    @kvtool_command
    def eval_cmd(
        inputs: Annotated[list[str], typer.Argument(help="Capture files (and, after --formats, more sweep specs).", show_default=False)],
        formats: Annotated[list[str] | None, typer.Option("--formats", "-F", help="Sweep spec NAME[:key=v1,v2,...]; repeatable, or several after one --formats.")] = None,
        paper: Annotated[bool | None, typer.Option("--paper/--no-paper", help="Add the papers' comparison rows (default: on without --formats).")] = None,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder for eval.json, eval.csv and the plot (default: CAPTURE.eval/).", file_okay=False)] = None,
        heldout: Annotated[int, typer.Option(help="Last tokens kept dense; their queries are scored.")] = 64,
        backend: Annotated[str, typer.Option(help=f"{'|'.join(BACKENDS)}: attention path for the compressed prefix.")] = "auto",
        model: Annotated[str | None, typer.Option("--model", "-m", help="Model for the continuation (default: the embedded one when the capture came from it).")] = None,
        no_model: Annotated[bool, typer.Option("--no-model", help="Attention-level metrics only (faster).")] = False,
        generate: Annotated[int, typer.Option(help="Greedy tokens to compare after the continuation.")] = 0,
        metric: Annotated[str | None, typer.Option(help=f"Frontier y axis: {'|'.join(METRICS)} (default: agreement with a model, else rel_l2).")] = None,
        x: Annotated[str, typer.Option("--x", help="Frontier x axis: storage|traffic (% of dense bytes).")] = "storage",
        layers: Annotated[str | None, typer.Option("--layers", help="Compress only these layers, e.g. 0,7,15,23 (the model runs the others densely; default: all captured).")] = None,
        force: Annotated[bool, typer.Option("--force", "-f", help="Recompute every point instead of resuming from eval.json.")] = False,
        device: Annotated[str | None, typer.Option("--device", help=DEVICE_HELP)] = None,
        threads: Annotated[int, typer.Option(help="Torch CPU threads (many small operations: 1 is fastest on a shared machine).", min=1)] = 1,
        texts: Annotated[list[str] | None, typer.Option("--texts", help="Also score the model on held-out texts: 'shipped' (kvtool's prose, code, dialogue) or your text files; rows gain mean and 95% interval over the capture and the texts (about 3 s more per point and text).")] = None,
        json_out: JsonOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        captures, specs = split_inputs(inputs, formats or [])
        use_paper = (not specs) if paper is None else paper
        out_dir = out or captures[0].with_name(f"{captures[0].stem}.eval")
        with library_progress(json_out) as progress:
            result = run_eval(captures, specs, out_dir, use_paper, heldout, backend, model, not no_model, generate, metric, x, force,
                              progress=progress, debug=debug_enabled(debug), layers=layers, device=device, threads=threads, texts=texts)
        if json_out:
            emit_json({"files": result["files"], "resumed": result["resumed"], "metric": result["metric"], "x": result["x"], "points": result["rows"]})
        else:
            print_results(result)
