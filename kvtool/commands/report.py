"""``kvtool report``: one self-contained HTML report of a capture (see :mod:`kvtool.analysis.html_report`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvtool.core.errors import UsageError
from kvtool.commands._common import (
    CaptureArg,
    DebugOpt,
    ForceOpt,
    JsonOpt,
    console,
    emit_json,
    example_epilog,
    kvtool_command,
)

ORDER = 58
SHORT_HELP = "One self-contained HTML report: cache, frontier, plans, kernels"


def register(app: typer.Typer) -> None:
    @app.command(
        "report",
        help="Write one self-contained HTML report (figures inlined, no network) of a capture: model facts; where "
        "the cache can be cut (outliers, attention concentration, head importance); the frontier of every format; "
        "the recommended plan per budget with its model-level cost and 95% intervals over held-out texts; kernel "
        "timings from kvtool bench JSON. Each section opens with a short reading of its numbers.",
        epilog=example_epilog(
            "kvtool report cap.safetensors -o report.html",
            "kvtool report cap.safetensors --eval eval --bench att.json --budgets 15%,25% -o report.html",
        ),
    )
    @kvtool_command
    def report(
        capture: CaptureArg,
        output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file.", dir_okay=False)] = Path("report.html"),
        eval_dir: Annotated[Path | None, typer.Option("--eval", help="A kvtool eval output folder (its eval.json) to add its frontier.", file_okay=False)] = None,
        bench: Annotated[list[Path] | None, typer.Option("--bench", help="kvtool bench --json files (repeatable).", dir_okay=False)] = None,
        budgets: Annotated[str, typer.Option("--budgets", help="Comma-separated budgets for the recommendation section.")] = "10%,15%,25%,40%",
        model: Annotated[str | None, typer.Option("--model", "-m", help="Model for the checks (default: the embedded one when the capture came from it).")] = None,
        no_model: Annotated[bool, typer.Option("--no-model", help="Predicted costs only (much faster).")] = False,
        no_texts: Annotated[bool, typer.Option("--no-texts", help="Check on the capture's continuation only.")] = False,
        heldout: Annotated[int, typer.Option(help="Held-out tokens (as recommend).")] = 64,
        force: ForceOpt = False,
        json_out: JsonOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        from kvtool.analysis.html_report import build_report  # deferred: start-up time
        from kvtool.core import io  # deferred: start-up time

        if not capture.exists():
            raise UsageError(f"capture {capture}: no such file")
        io.check_output(output, force)
        chosen = [b.strip() for b in budgets.split(",") if b.strip()]
        if not chosen:
            raise UsageError("--budgets is empty; write e.g. 10%,15%,25%,40%")
        started = time.perf_counter()
        progress = None if json_out else (lambda msg: print(f"[{time.perf_counter() - started:5.0f} s] {msg}", file=sys.stderr, flush=True))
        text, summary = build_report(capture, chosen, eval_dir, bench, not no_model, not no_texts, model, heldout, progress=progress)
        io.atomic_write_text(output, text, force=True)
        summary["output"] = str(output)
        summary["bytes"] = len(text.encode())
        if json_out:
            summary["budgets"] = [{("budget_spec" if k == "budget" else k): v for k, v in b.items()} for b in summary.get("budgets", [])]
            emit_json(summary, input=capture, output=output)
        else:
            for b in summary["budgets"]:
                console.print(b["reading"])
            console.print(f"wrote {output} ({summary['bytes'] / 1024:.0f} KiB, {summary['figures']} figures, {summary['seconds']:.0f} s)")
