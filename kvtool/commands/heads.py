"""``kvtool heads``: which attention heads matter per token (Polar Sparsity's selective head attention)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import (
    DeviceOpt,
    CaptureArg,
    ForceOpt,
    LayersOpt,
    console,
    deprecated,
    example_epilog,
    make_table,
    show,
)
from kvtool.core.progress import Progress

ORDER = 45
SHORT_HELP = "Attention-head selection: oracle error curve and trained routers"


def print_report(rep: dict[str, Any], capture: Any = None, router_file: Any = None) -> None:
    show("[bold]{}[/bold]: {} heads, {} KV heads, {} tokens; router trained on the first {} tokens, scored on the last {}",
         capture, rep["num_heads"], rep["num_kv_heads"], rep["tokens"], rep["tokens"] - rep["heldout"], rep["heldout"])
    rows = [(r["k"], f"{r['density']:.3f}", r["rel_l2"], f"{r['traffic_ratio']:.3f}") for r in rep["curve"]]
    console.print(make_table("oracle top-k heads by output norm (mean over layers, every token)", ["k", "head density k/H", "rel. L2 error", "KV traffic"], rows))
    rows = [(r["groups"], f"{r['traffic_ratio']:.3f}", r["rel_l2"]) for r in rep["group_curve"]]
    console.print(make_table("oracle top KV groups (whole GQA groups)", ["groups", "KV traffic", "rel. L2 error"], rows))
    rows = []
    for name, lrep in rep["layers"].items():
        a = lrep["at_k"]
        rows.append((name, a["oracle"]["rel_l2"], a.get("router", {}).get("recall"), a.get("router", {}).get("rel_l2"), a["static"]["recall"], a["static"]["rel_l2"], a["random"]["recall"], a["random"]["rel_l2"]))
    s = rep["at_k"]
    rows.append(("mean", s["oracle"]["rel_l2"], s.get("router", {}).get("recall"), s.get("router", {}).get("rel_l2"), s["static"]["recall"], s["static"]["rel_l2"], s["random"]["recall"], s["random"]["rel_l2"]))
    console.print(
        make_table(
            f"k = {rep['k']} of {rep['num_heads']} heads (density {rep['density']:.3f}), held-out tokens",
            ["layer", "oracle err", "router recall", "router err", "static recall", "static err", "random recall", "random err"],
            rows,
        )
    )
    if rep.get("router_skipped"):
        show("[yellow]router skipped:[/yellow] {}", rep["router_skipped"])
    if router_file is not None:
        show("wrote routers to {}", router_file)
    if rep.get("plot_file"):
        show("wrote plot to {}", rep["plot_file"])


@declare(
    "heads",
    help="Attention-head selection (Polar Sparsity): per token and head the attention output norm; the error "
    "when only the top-k heads are computed, for k = 1..heads (oracle) and per KV group; a per-layer linear "
    "router trained on the hidden states (capture with --hidden) to predict each token's top-k heads, scored "
    "on held-out tokens against the oracle, a fixed best-on-average head set and random heads.",
    epilog=example_epilog(
        "kvtool heads sample:",
        "kvtool heads sample: --top-k 3 -o routers.safetensors --plot-output heads.png --json",
    ),
    render=lambda outcome: print_report(outcome.data, outcome.input, outcome.output),
)
def heads(
    capture: CaptureArg,
    top_k: Annotated[int | None, typer.Option("--top-k", "-k", help="Heads computed per token for the router comparison (default: half, rounded up).")] = None,
    k_old: Annotated[int | None, typer.Option("--k", hidden=True, help="Deprecated name of --top-k.")] = None,
    heldout: Annotated[int, typer.Option(help="Last tokens held out from router training and used to score it.")] = 128,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Save the routers as safetensors (needs --hidden in the capture).", dir_okay=False)] = None,
    router_out_old: Annotated[Path | None, typer.Option("--router-out", hidden=True, help="Deprecated name of --output.", dir_okay=False)] = None,
    plot_output: Annotated[Path | None, typer.Option("--plot-output", help="Write the error-vs-density plot (PNG).", dir_okay=False)] = None,
    plot_old: Annotated[Path | None, typer.Option("--plot", hidden=True, help="Deprecated name of --plot-output.", dir_okay=False)] = None,
    steps: Annotated[int, typer.Option(help="Router training steps (full-batch Adam).", min=1)] = 300,
    seed: Annotated[int, typer.Option(help="Seed for router initialisation and the random baseline.")] = 0,
    layers: LayersOpt = None,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis.file_drivers import heads_file  # deferred: start-up time

    for old, new, value in (("--k", "--top-k", k_old), ("--router-out", "--output", router_out_old), ("--plot", "--plot-output", plot_old)):
        if value is not None:
            deprecated(old, new)
    top_k = top_k if top_k is not None else k_old
    output = output or router_out_old
    plot_output = plot_output or plot_old
    report = heads_file(capture, top_k, heldout, layers, output, plot_output, steps, seed, force, progress=progress, device=device)
    router_file = report.pop("router_file", None)  # the envelope's output
    return Outcome(report, input=capture, output=router_file)

def register(app: typer.Typer) -> None:
    add_commands(app, heads)
