"""``kvtool report``: one self-contained HTML report of a capture (see :mod:`kvtool.analysis.html_report`)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from kvtool.core.errors import UsageError
from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import (
    DeviceOpt,
    ModelOpt,
    NoModelOpt,
    model_choice,
    CaptureArg,
    ForceOpt,
    console,
    example_epilog,
)
from kvtool.core.progress import Progress

ORDER = 58
SHORT_HELP = "One self-contained HTML report: cache, frontier, plans, kernels"


def print_reported(outcome: Outcome) -> None:
    summary = outcome.data
    for b in summary["budgets"]:
        console.print(b["reading"], markup=False)
    console.print(f"wrote {outcome.output} ({summary['bytes'] / 1024:.0f} KiB, {summary['figures']} figures, {summary['seconds']:.0f} s)", markup=False)


@declare(
    "report",
    help="Write one self-contained HTML report (figures inlined, no network) of a capture. Its first screen answers "
    "'what should I use at my budget?': per budget the plan in words, its GiB at --batch x --context, its decode speed against "
    "dense when a kvtool bench decode JSON is given, its fidelity, and the command that applies it. Then: model facts; where "
    "the cache can be cut (outliers, attention concentration, head importance); the frontier of every format; "
    "the recommended plan per budget with its model-level cost and 95% intervals over held-out texts; kernel "
    "timings from kvtool bench JSON. Each section opens with a short reading of its numbers.",
    epilog=example_epilog(
        "kvtool report cap.safetensors -o report.html",
        "kvtool report cap.safetensors --budgets 15%,25% --batch 16 --context 32k --bench decode.json -o report.html",
    ),
    render=print_reported,
)
def report(
    capture: CaptureArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file.", dir_okay=False)] = Path("report.html"),
    eval_dir: Annotated[Path | None, typer.Option("--eval", help="A kvtool eval output folder (its eval.json) to add its frontier.", file_okay=False)] = None,
    bench: Annotated[list[Path] | None, typer.Option("--bench", help="JSON files written by kvtool bench ... -o FILE (repeatable); a kvtool bench decode file gives each plan's tokens/s against dense.", dir_okay=False)] = None,
    tasks_dir: Annotated[Path | None, typer.Option("--tasks", help="A kvtool tasks output folder (its tasks.json) to add task accuracy.", file_okay=False)] = None,
    budgets: Annotated[str, typer.Option("--budgets", help="Comma-separated budgets for the recommendation section.")] = "10%,15%,25%,40%",
    batch: Annotated[int, typer.Option(help="Sequences served at once: the first screen's GiB (and a size budget such as 2GiB) are for this batch.", min=1)] = 8,
    context: Annotated[str, typer.Option(help="Tokens per sequence, e.g. 32k: the first screen's GiB (and a size budget) are for this context.")] = "32k",
    model: ModelOpt = None,
    no_model: NoModelOpt = False,
    no_texts: Annotated[bool, typer.Option("--no-texts", help="Check on the capture's continuation only.")] = False,
    heldout: Annotated[int, typer.Option(help="Held-out tokens (as recommend).")] = 64,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis.html_report import build_report  # deferred: start-up time
    from kvtool.core import io  # deferred: start-up time

    if not capture.exists():
        raise UsageError(f"capture {capture}: no such file")
    io.check_output(output, force)
    chosen = [b.strip() for b in budgets.split(",") if b.strip()]
    if not chosen:
        raise UsageError("--budgets is empty; write e.g. 10%,15%,25%,40%")
    from kvtool.analysis.allocation import parse_count  # deferred: start-up time

    tokens = parse_count(context, "--context")
    model, use_model = model_choice(model, no_model)
    line = ["kvtool", "report", str(capture), "--budgets", ",".join(chosen), "--batch", str(batch), "--context", context, "--heldout", str(heldout), "-o", str(output)]
    line += (["--eval", str(eval_dir)] if eval_dir else []) + [a for b in bench or [] for a in ("--bench", str(b))]
    line += (["--model", str(model)] if model else []) + ([] if use_model else ["--no-model"]) + (["--no-texts"] if no_texts else [])
    line += ["--tasks", str(tasks_dir)] if tasks_dir else []
    text, summary = build_report(capture, chosen, eval_dir, bench, use_model, not no_texts, model, heldout, progress=progress, device=device,
                                 command=shlex.join(line), tasks_dir=tasks_dir, batch=batch, context=tokens)
    io.atomic_write_text(output, text, force=True)
    summary["bytes"] = len(text.encode())
    summary.pop("answers", None)  # the first screen's per-budget answers stay in the Python result (no --json keys for them yet)
    summary["budgets"] = [{("budget_spec" if k == "budget" else k): v for k, v in b.items()} for b in summary.get("budgets", [])]
    return Outcome(summary, input=capture, output=output)

def register(app: typer.Typer) -> None:
    add_commands(app, report)
