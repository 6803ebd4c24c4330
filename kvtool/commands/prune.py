"""``kvtool prune``: prune a capture's keys and values (Mustafar's methods and baselines) and write
the pruned capture (same schema; pruned elements are zero)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .. import io
from ..cache import parse_indices
from ..prune import DEFAULT_WINDOW, METHODS, check_sparsity, method_needs_queries, parse_method, prune_cache
from ._common import CaptureArg, DebugOpt, ForceOpt, JsonOpt, LayersOpt, console, emit_json, example_epilog, kvtool_command, make_table, progress_bar

ORDER = 38


def prune_file(
    capture: Path,
    output: Path | None = None,
    sparsity: float = 0.7,
    key_sparsity: float | None = None,
    value_sparsity: float | None = None,
    method: str = "per-token",
    dense_window: int = DEFAULT_WINDOW,
    layers: str | None = None,
    force: bool = False,
    quiet: bool = True,
) -> dict[str, Any]:
    """Prune ``capture`` and write the pruned capture; returns the report (achieved sparsity per
    layer and overall, output path)."""
    ks = check_sparsity(sparsity if key_sparsity is None else key_sparsity, "--key-sparsity" if key_sparsity is not None else "--sparsity")
    vs = check_sparsity(sparsity if value_sparsity is None else value_sparsity, "--value-sparsity" if value_sparsity is not None else "--sparsity")
    parse_method(method)
    if dense_window < 0:
        from ..errors import UsageError

        raise UsageError(f"--dense-window must be at least 0, got {dense_window}")
    output = output or capture.with_name(f"{capture.stem}.pruned.safetensors")
    io.check_output(output, force)
    meta, _ = io.read_header(capture)
    io.check_schema(capture, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(capture, meta)
    selected = parse_indices(layers, facts.num_layers) if layers else None
    parts = ("keys", "values", "queries", "hidden")
    cache = io.load(capture, layers=selected, parts=parts)
    if method_needs_queries(method) and not cache.has_queries:
        from ..errors import UsageError

        raise UsageError(f"--method {method} needs queries but {capture} has none; recapture without --no-queries")
    with progress_bar(quiet) as bar:
        task = bar.add_task("pruning", total=len(cache.layers))
        pruned, report = prune_cache(cache, ks, vs, method, dense_window, progress=lambda i: bar.advance(task))
    pruned.info = {**cache.info, "pruned": {k: v for k, v in report.items() if k != "per_layer"}, "pruned_from": str(capture), "pruned_from_sha256": io.sha256_file(capture)}
    path = io.save(pruned, output, force=force)
    report["output"] = str(path)
    report["layers"] = pruned.layer_indices
    report["tokens"] = pruned.num_tokens
    return report


def register(app: typer.Typer) -> None:
    @app.command(
        "prune",
        help="Prune the keys and values of a capture to a target sparsity and write the pruned capture "
        f"(pruned elements set to zero, same schema). Methods: {', '.join(METHODS)}; give one for keys and values "
        "or KEYS/VALUES (e.g. output-aware/per-token). The most recent --dense-window tokens are never pruned; "
        "every token keeps exactly round((1 - sparsity) * head_dim) elements (ties: the lower index wins).",
        epilog=example_epilog(
            "kvtool prune cap.safetensors --sparsity 0.7 -o cap.pruned.safetensors",
            "kvtool prune cap.safetensors --key-sparsity 0.5 --value-sparsity 0.7 --method output-aware/per-token --json",
        ),
    )
    @kvtool_command
    def prune(
        capture: CaptureArg,
        output: Annotated[Path | None, typer.Option("--output", "-o", help="Output capture (default: CAPTURE.pruned.safetensors).", dir_okay=False)] = None,
        sparsity: Annotated[float, typer.Option(help="Fraction of elements pruned, keys and values.")] = 0.7,
        key_sparsity: Annotated[float | None, typer.Option(help="Key sparsity (overrides --sparsity).")] = None,
        value_sparsity: Annotated[float | None, typer.Option(help="Value sparsity (overrides --sparsity).")] = None,
        method: Annotated[str, typer.Option(help=f"Pruning method: {', '.join(METHODS)}, or KEYS/VALUES.")] = "per-token",
        dense_window: Annotated[int, typer.Option(help="Most recent tokens left untouched.")] = DEFAULT_WINDOW,
        layers: LayersOpt = None,
        force: ForceOpt = False,
        json_out: JsonOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        report = prune_file(capture, output, sparsity, key_sparsity, value_sparsity, method, dense_window, layers, force, quiet=json_out)
        if json_out:
            emit_json(report)
            return
        console.print(
            f"[bold]{report['method']}[/bold]: target key sparsity {report['key_sparsity']}, value sparsity {report['value_sparsity']}; "
            f"the last {report['dense_window']} tokens untouched"
        )
        rows = [(layer, v["achieved_key_sparsity"], v["achieved_value_sparsity"]) for layer, v in report["per_layer"].items()]
        rows.append(("all", report["achieved_key_sparsity"], report["achieved_value_sparsity"]))
        console.print(make_table("achieved sparsity (of the pruned tokens)", ["layer", "keys", "values"], rows))
        console.print(f"wrote {report['output']}")
