"""``kvtool prune``: prune a capture's keys and values (Mustafar's methods and baselines) and write
the pruned capture (same schema; pruned elements are zero)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands._command import Api, Outcome, add_commands, declare
from kvtool.commands._common import (
    CaptureArg,
    ForceOpt,
    LayersOpt,
    console,
    example_epilog,
    make_table,
    show,
)
from kvtool.core.progress import Progress

ORDER = 38
SHORT_HELP = "Prune keys/values to an exact sparsity (Mustafar, ThinK, 2:4)"

# kvtool.methods.prune.METHODS and DEFAULT_WINDOW, named here so that --help needs no torch
# (tests/test_cli.py checks they agree)
METHOD_NAMES = ("per-token", "per-channel", "output-aware", "think", "2:4")
DEFAULT_DENSE_WINDOW = 32


def print_pruned(outcome: Outcome) -> None:
    report = outcome.data
    show("[bold]{}[/bold]: target key sparsity {}, value sparsity {}; the last {} tokens untouched (--dense-window)",
         report["method"], report["key_sparsity"], report["value_sparsity"], report["dense_window"])
    rows = [(e["layer"], e["achieved_key_sparsity"], e["achieved_value_sparsity"]) for e in report["layers"]]
    rows.append(("all", report["achieved_key_sparsity"], report["achieved_value_sparsity"]))
    console.print(make_table("achieved sparsity (of the pruned tokens)", ["layer", "keys", "values"], rows))
    show("wrote {}", report["output"])


@declare(
    "prune",
    help="Prune the keys and values of a capture to a target sparsity and write the pruned capture "
    f"(pruned elements set to zero, same schema). Methods: {', '.join(METHOD_NAMES)}; give one for keys and values "
    "or KEYS/VALUES (e.g. output-aware/per-token). The most recent --dense-window tokens are never pruned; "
    "every token keeps exactly round((1 - sparsity) * head_dim) elements (ties: the lower index wins).",
    epilog=example_epilog(
        "kvtool prune cap.safetensors --sparsity 0.7 -o cap.pruned.safetensors",
        "kvtool prune cap.safetensors --key-sparsity 0.5 --value-sparsity 0.7 --method output-aware/per-token --json",
    ),
    render=print_pruned,
)
def prune(
    capture: CaptureArg,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output capture (default: CAPTURE.pruned.safetensors).", dir_okay=False), Api(positional=True)] = None,
    sparsity: Annotated[float, typer.Option(help="Fraction of elements pruned, keys and values.")] = 0.7,
    key_sparsity: Annotated[float | None, typer.Option(help="Key sparsity (overrides --sparsity).")] = None,
    value_sparsity: Annotated[float | None, typer.Option(help="Value sparsity (overrides --sparsity).")] = None,
    method: Annotated[str, typer.Option(help=f"Pruning method: {', '.join(METHOD_NAMES)}, or KEYS/VALUES.")] = "per-token",
    dense_window: Annotated[int, typer.Option(help="Most recent tokens left untouched.")] = DEFAULT_DENSE_WINDOW,
    layers: LayersOpt = None,
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.methods.prune import prune_file  # deferred: start-up time

    report = prune_file(capture, output, sparsity, key_sparsity, value_sparsity, method, dense_window, layers, force, progress=progress)
    return Outcome(report, input=capture, output=report.get("output"))


def register(app: typer.Typer) -> None:
    add_commands(app, prune)
